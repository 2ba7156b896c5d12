"""What a user's ``pip install`` gets: every package of the source tree is in the wheel.

``pyproject.toml`` lists the packages by name (``aggregator/`` and ``worker/`` are installed under the
``omnireduce`` namespace through ``package-dir``), so a new subpackage must be added there; a missing
one installs fine and fails only at import, on the user's machine. Built for real, as pip builds it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    import tomllib  # novm: 3.11 and later
except ImportError:  # Python 3.10: the same parser, as the package tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _source_packages() -> set[str]:
    """Every package of the source tree, named as installed (from pyproject's ``package-dir``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in config["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]))
    return found


def test_every_package_of_the_source_tree_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    missing = _source_packages() - set(config["packages"])
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_the_wheel_holds_every_package(tmp_path: Path) -> None:
    src = tmp_path / "src"  # (a copy: an in-tree build would leave build/ in the checkout)
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "results", "docs", "tests",
                                                             "scripts", "__pycache__", "*.egg-info", ".wheels"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
                   check=True, timeout=300, capture_output=True)
    (wheel,) = tmp_path.glob("omnireduce-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert _source_packages() <= shipped, sorted(_source_packages() - shipped)
    assert "omnireduce/ddp/hook.py" in names and "omnireduce/py.typed" in names
