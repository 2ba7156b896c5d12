"""The end of a user's script of ``omnireduce.distributed.all_reduce`` on a Gloo job of 2 ranks
(``tests/scripts/distributed_exit.py``: twelve calls, then the interpreter's exit, with or without
``shutdown()`` and ``destroy_process_group()``), each run two processes of their own. Every rank must
exit 0 with no "terminate called" (or other trouble) on stderr, and nothing of omnireduce's may keep a
Gloo group alive into the interpreter's shutdown: once omnireduce's exit handlers have run, neither
omnireduce's own group nor, after ``destroy_process_group()``, the program's default group is held.

Before, omnireduce held both: a Gloo worker thread still dropping its last work at the shutdown could not
take the GIL, and the process aborted after a complete run (here, a third to a half of the ranks of the
``shutdown-destroy`` end and a fifth of ``destroy``'s; 8 of 300 ranks of plain scripts without the
amplifiers this script uses). The abort is a race: ``make test``
runs the script 5 times, the ends in turn, ``make exit-loop`` 48 times (marker ``slow``); what is held
is checked on every run, and does not depend on the race."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.exit_runs import two_ranks

SCRIPT = str(Path(__file__).parent / "scripts" / "distributed_exit.py")
ENDS = ("shutdown-destroy", "exit", "destroy", "shutdown")


def _run(end: str, timeout: float = 120.0) -> list[str]:
    """One job of 2 ranks ending with ``end``: what went wrong on each rank (empty: nothing)."""
    want = ["calls 12", "private freed", *(["world freed"] if "destroy" in end else [])]
    return two_ranks(SCRIPT, [end], want, end, timeout)


def _failures(runs: int) -> list[str]:
    return [problem for i in range(runs) for problem in _run(ENDS[i % len(ENDS)])]


def test_a_distributed_script_exits_cleanly() -> None:
    failures = _failures(5)
    assert not failures, f"{len(failures)} rank(s) of 5 runs failed:\n" + "\n\n".join(failures[:4])


@pytest.mark.slow
@pytest.mark.timeout(900)  # (48 runs of 3-5 s, more on a loaded machine)
def test_a_distributed_script_exits_cleanly_48_times() -> None:
    failures = _failures(48)
    assert not failures, f"{len(failures)} rank(s) of 48 runs failed:\n" + "\n\n".join(failures[:4])
