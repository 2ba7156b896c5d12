"""Run a training script as ``omnireduce-run``'s torchrun child and record how it ended.

torchrun reports any failed worker as exit code 1; ``omnireduce-run`` promises the failing worker's
own exit code. So each worker runs ``python -m omnireduce.launch.child script.py args...``, which runs the
script as ``__main__`` and, if it ends with a non-zero code, writes ``<code> <monotonic time>`` to
``$OMNIREDUCE_RUN_DIR/exit-<rank>`` before exiting with that code. The launcher picks the earliest.
The directory is read (and checked to exist) before the script runs, by
:func:`omnireduce.launch.settings.env_run_dir`.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from omnireduce.launch.settings import env_run_dir


def _record(run_dir: str | None, code: int) -> None:
    if run_dir and code:
        path = os.path.join(run_dir, f"exit-{os.environ.get('RANK', '0')}")
        with open(path, "w") as f:
            f.write(f"{code} {time.monotonic()}\n")


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: python -m omnireduce.launch.child script.py [args...]")
    try:
        run_dir = env_run_dir()
    except ValueError as e:
        sys.exit(f"omnireduce.launch.child: {e}")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _record(run_dir, code)
    sys.exit(code)


if __name__ == "__main__":
    main()
