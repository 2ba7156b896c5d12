"""scripts/check_layers.py: the repository keeps its layers, has no import cycle and no oversized module or
function; and on a small package made here with one of each fault, the checker fails naming each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_layers.py"


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root)], capture_output=True, text=True,
                          timeout=120)


def test_the_repository_passes() -> None:
    r = _check(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == "", r.stdout


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_package_with_faults_fails_naming_each(tmp_path: Path) -> None:
    long_body = "".join(f"    x += {i}\n" for i in range(70))
    files = {
        "omnireduce/__init__.py": '"""The package."""\n',
        "omnireduce/cuda/__init__.py": '"""CUDA."""\n',
        "omnireduce/cuda/ops.py": '"""Ops."""\n',
        "omnireduce/launch/__init__.py": '"""Launching."""\n',
        "omnireduce/launch/procs.py": '"""Processes."""\n',
        # (a) the ground floor importing a higher layer, inside a function
        "omnireduce/envvars.py": '"""Ground."""\n\n\ndef f() -> None:\n    from omnireduce.cuda import ops\n\n'
                                 '    print(ops)\n',
        # (a) the ground floor importing torch at module level; the aggregator importing sideways
        "omnireduce/plain.py": '"""Ground."""\n\nimport torch\n\nprint(torch)\n',
        "omnireduce/aggregator/__init__.py": '"""Aggregator."""\n',
        "omnireduce/aggregator/cli.py": '"""CLI."""\n\nfrom omnireduce.launch.procs import x\n\nprint(x)\n',
        # (b) a cycle, one of its edges under TYPE_CHECKING
        "omnireduce/first.py": '"""First."""\n\nfrom omnireduce import second\n\nprint(second)\n',
        "omnireduce/second.py": '"""Second."""\n\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n'
                                '    from omnireduce import first\n',
        # (c) a function of 73 lines, and a module of 501
        "omnireduce/long.py": f'"""Long."""\n\n\ndef long_one() -> int:\n    x = 0\n{long_body}    return x\n',
        "omnireduce/big.py": '"""Big."""\n' + "y = 1\n" * 500,
    }
    for name, text in files.items():
        _write(tmp_path, name, text)
    r = _check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()

    def one(*parts: str) -> str:
        found = [ln for ln in lines if all(p in ln for p in parts)]
        assert len(found) == 1, (parts, r.stdout)
        return found[0]

    assert "higher layer" in one("omnireduce/envvars.py:5:", "imports omnireduce.cuda.ops (cuda)", "function import")
    one("omnireduce/plain.py:3:", "imports torch at module level")
    one("omnireduce/aggregator/cli.py:3:", "imports omnireduce.launch.procs (launch)", "sideways")
    cycle = one("import cycle between omnireduce.first, omnireduce.second")
    assert "omnireduce/second.py:6" in cycle and "(type-checking)" in cycle, cycle
    one("omnireduce/long.py:4:", "function long_one has 73 lines, more than 60")
    one("omnireduce/big.py:1:", "module omnireduce.big has 501 lines, more than 500")
    assert len(lines) == 6, r.stdout


def test_scripts_with_a_cycle_and_a_package_that_imports_them_fail(tmp_path: Path) -> None:
    """Rule (d): a cycle among scripts (one through the scripts' own package ``ombench``, one edge inside a
    function), and a module of the package importing a script; a script importing the package is fine."""
    files = {
        "omnireduce/__init__.py": '"""The package."""\n',
        "omnireduce/tool.py": '"""Ground."""\n\n\ndef f() -> None:\n    import ombench.helpers\n\n'
                              '    print(ombench.helpers)\n',
        "scripts/ombench/__init__.py": '"""Helpers."""\n',
        "scripts/ombench/helpers.py": '"""Helpers."""\n\nimport runner\n\nprint(runner)\n',
        "scripts/runner.py": '"""A script."""\n\nimport omnireduce\n\n\ndef main() -> None:\n'
                             '    from ombench.helpers import x\n\n    print(x, omnireduce)\n',
        "scripts/alone.py": '"""Another script."""\n\nimport runner\n\nprint(runner)\n',
    }
    for name, text in files.items():
        _write(tmp_path, name, text)
    r = _check(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    cycles = [line for line in lines if "import cycle" in line]
    assert len(cycles) == 1 and "ombench.helpers, runner" in cycles[0] and "(function)" in cycles[0], lines
    (package,) = [line for line in lines if "a module of scripts/" in line]
    assert package.startswith("omnireduce/tool.py:5: omnireduce.tool imports ombench.helpers"), package
    assert len(lines) == 2, lines
