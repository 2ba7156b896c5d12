#!/usr/bin/env python3
"""Type-check the whole installed package with mypy, laid out as it installs (run by ``make lint``).

``aggregator/`` and ``worker/`` install as ``omnireduce.aggregator`` and ``omnireduce.worker``
(pyproject's ``package-dir``), which mypy cannot see from the source tree. So this lays the package
out as it installs, in a temporary folder of symbolic links to the real files, and runs
``mypy -p omnireduce`` there (settings: ``[tool.mypy]`` in pyproject.toml). Errors name the real
files' paths relative to the repository.

    python scripts/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib  # novm: 3.11 and later
except ImportError:  # Python 3.10: the same parser, as the package tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def lay_out(dest: Path) -> None:
    """Symbolic links in ``dest`` that give the package its installed shape."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = dest.joinpath(*name.split("."))
        if name.count(".") == 0:
            target.mkdir(parents=True)
            for entry in (ROOT / folder).iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(ROOT / folder, target_is_directory=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="omnireduce-typecheck-") as tmp:
        lay_out(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), "-p", "omnireduce",
               *sys.argv[1:]]
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        sys.stdout.write(done.stdout.replace(tmp + "/", ""))
        sys.stderr.write(done.stderr)
        return done.returncode


if __name__ == "__main__":
    sys.exit(main())
