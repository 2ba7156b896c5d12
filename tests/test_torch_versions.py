"""What needs a newer torch than the package says so: FSDP2's integration refuses a torch older than 2.9
(FSDP2's all-reduce hook came in 2.7; torch 2.8's Gloo reduce-scatter returns the sum where FSDP2 asks for
the average), naming the version found and the one needed, through both ways in, on this torch with its
version string set back (make test-oldest-torch runs this on torch 2.8.0 itself); on any torch
``use_omnireduce`` still tells a plain module apart from an FSDP one. The package's floor, 2.8, is the
same wherever it is said."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from omnireduce.integrations import fsdp, use_omnireduce
from omnireduce.integrations.fsdp.units import NEEDS_TORCH, torch_release

ROOT = Path(__file__).resolve().parent.parent


def test_torch_release_reads_major_and_minor() -> None:
    assert torch_release("2.10.0a0+git1234abc") == (2, 10) > NEEDS_TORCH  # (a string compare would say older)
    assert torch_release("2.9.1+cu128") >= NEEDS_TORCH > torch_release("2.8.0+cu128")
    with pytest.raises(ValueError, match="not a torch version"):
        torch_release("nightly")


@pytest.mark.parametrize("older", ["2.8.0+cu128", "2.6.0"])
def test_fsdp2_on_an_older_torch_names_the_version_found_and_the_one_needed(
        monkeypatch: pytest.MonkeyPatch, older: str) -> None:
    assert torch_release(older) < NEEDS_TORCH
    monkeypatch.setattr(torch, "__version__", older)
    model = nn.Linear(2, 2)
    for call in (use_omnireduce, fsdp.use_omnireduce):
        with pytest.raises(RuntimeError) as e:
            call(model, mesh=object())
        message = str(e.value)
        assert "needs torch 2.9 or later" in message and f"this is torch {older}" in message, message
        assert "torch 2.8's Gloo reduce-scatter returns the sum" in message, message


def test_a_plain_module_is_not_taken_for_fsdp_on_any_torch() -> None:
    with pytest.raises(TypeError, match="Trainer or a TorchRec DistributedModelParallel"):
        use_omnireduce(nn.Linear(2, 2))


def test_the_torch_floor_is_the_same_in_pyproject_the_readme_and_make_test_oldest_torch() -> None:
    floors = set(re.findall(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()))
    assert floors == {"2.8"}, floors
    assert NEEDS_TORCH == (2, 9)  # (the FSDP2 integration's own, above the package's)
    shown = subprocess.run(["make", "-s", "--no-print-directory", "--eval", "show-oldest: ; @echo $(OLDEST_TORCH)",
                            "show-oldest"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert shown.stdout.strip() == "2.8.0", shown  # what make test-oldest-torch installs
    assert "| `make test-oldest-torch` | 3.10 | 2.8.0 |" in (ROOT / "README.md").read_text()
