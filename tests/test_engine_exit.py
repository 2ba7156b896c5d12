"""The collective engine's end in a script that profiles it and exits at once
(``tests/scripts/engine_profiler_exit.py``: a 1-rank Gloo group, ``CollectiveEngine.for_group``,
reductions, a ``torch.profiler`` block, ``close()``, ``destroy_process_group()``, the interpreter's exit),
each run a process of its own. Every run must exit 0 with no "terminate called" on stderr.

Before ``close()`` waited for the engine's thread, a fifth to a half of these runs aborted at exit here
(docs/log/2026-11-29-engine-exit-abort.md). The race needs many runs to show: ``make test`` runs the
script 5 times (a few seconds each), ``make exit-loop`` 50 times (marker ``slow``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from omnireduce.launch.procs import free_port
from tests.harness import own_output

SCRIPT = str(Path(__file__).parent / "scripts" / "engine_profiler_exit.py")
# what a user would read as trouble (the profiler's own "profiler_start/stop" lines are not)
TROUBLE = re.compile(r"terminate|abort|warn|error|traceback|ignored|signal", re.IGNORECASE)
# kineto's probe when the profiler starts, in a CUDA build of torch on a machine without a GPU driver
# (code 35: no driver, or too old a one; make test-oldest-torch's torch is such a build): not the exit's trouble
NO_DRIVER = re.compile(r"DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code \d+$")


# close() ends the thread before it returns, and lets go of the group: destroy_process_group() frees it
_CLOSED = """
import sys, threading, weakref
import torch, torch.distributed as dist
from omnireduce.engines.collective import CollectiveEngine
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
engine = CollectiveEngine.for_group(dist.group.WORLD, 30.0, 256, 1024, 1)
x = torch.zeros(65536)
x[:256] = 1.0
engine.allreduce_async(x).wait()
group = weakref.ref(engine.group)
engine.close()
alive = [t.name for t in threading.enumerate() if t.name == "omnireduce-collective"]
dist.destroy_process_group()
print("threads", alive, "group", "held" if group() is not None else "freed")
"""


def test_close_ends_the_thread_and_lets_go_of_the_group() -> None:
    """The race above, made deterministic: once ``close()`` returns, the engine's thread has ended and
    nothing of the engine's holds its group (before, both could still be the case at the exit)."""
    p = subprocess.run([sys.executable, "-c", _CLOSED, str(free_port())], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert own_output(p.stdout).split() == ["threads", "[]", "group", "freed"], p.stdout


def _failures(runs: int) -> list[str]:
    """Run the script ``runs`` times, one after the other: what each failed run said."""
    failures = []
    for i in range(runs):
        p = subprocess.run([sys.executable, SCRIPT, str(free_port())], capture_output=True, text=True, timeout=120)
        trouble = [line for line in p.stderr.splitlines() if TROUBLE.search(line) and not NO_DRIVER.search(line)]
        if p.returncode != 0 or trouble or "reductions 330" not in p.stdout:
            failures.append(f"run {i}: exit code {p.returncode}, stdout {p.stdout.strip()!r}\n" +
                            "\n".join(trouble or p.stderr.splitlines()[-20:]))
    return failures


def test_a_profiled_engine_script_exits_cleanly() -> None:
    failures = _failures(5)
    assert not failures, f"{len(failures)} of 5 runs failed:\n" + "\n\n".join(failures[:3])


@pytest.mark.slow
@pytest.mark.timeout(900)  # (50 runs of 3-5 s, more on a loaded machine)
def test_a_profiled_engine_script_exits_cleanly_50_times() -> None:
    failures = _failures(50)
    assert not failures, f"{len(failures)} of 50 runs failed:\n" + "\n\n".join(failures[:3])
