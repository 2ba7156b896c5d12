"""The end of a user's DDP script with omnireduce's hook on the collective engine, a Gloo job of 2 ranks
(``tests/scripts/ddp_engine_exit.py``: a few steps, then the interpreter's exit, with or without
``destroy_process_group()``, or with a last collective left on the engine's group), each run two
processes of their own. Every rank must exit 0 with no "terminate called" (or other trouble) on stderr,
and the engine's own process group must be freed once omnireduce's exit handlers have run: a Gloo group
alive into the interpreter's shutdown keeps its worker threads, and one still dropping a collective's
tensors then cannot take the GIL and aborts the process.

Before, the group binding made for the engine stayed in torch's registry until the program's
``destroy_process_group()``: without it, the group was held at exit on every rank of every run (the
check here fails deterministically), and with a last collective left on it a fifth to a half of the
ranks aborted. ``make test`` runs the ends once each, ``make exit-loop`` 36 times (marker ``slow``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnireduce.launch.procs import free_port
from tests.exit_runs import two_ranks
from tests.harness import own_output

SCRIPT = str(Path(__file__).parent / "scripts" / "ddp_engine_exit.py")
ENDS = ("late", "exit", "destroy")


def _run(end: str, engine: str = "collective", timeout: float = 120.0) -> list[str]:
    """One job of 2 ranks ending with ``end``: what went wrong on each rank (empty: nothing)."""
    return two_ranks(SCRIPT, [end, engine], ["steps 4", "engine freed"], f"{end}, {engine}", timeout)


# close() destroys the group for_group made for the engine, never one the program gave it
_CLOSE = """
import sys, weakref
import torch, torch.distributed as dist
from omnireduce.engines.collective import CollectiveEngine
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
given = dist.new_group([0])
engines = [CollectiveEngine.for_group(dist.group.WORLD, 30.0, 256, 1024, 1),
           CollectiveEngine(given, 256, 1024, 1, timeout=30.0)]
for engine in engines:
    x = torch.zeros(65536)
    x[:256] = 1.0
    engine.allreduce_async(x).wait()
made = weakref.ref(engines[0].group)
for engine in engines:
    engine.close()
pgs = dist.distributed_c10d._world.pg_map
print("made", "held" if made() is not None else "freed", "given", given in pgs, "world", dist.group.WORLD in pgs)
dist.destroy_process_group()
"""


def test_close_destroys_the_engines_own_group_only() -> None:
    p = subprocess.run([sys.executable, "-c", _CLOSE, str(free_port())], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert own_output(p.stdout).split() == ["made", "freed", "given", "True", "world", "True"], p.stdout


def _failures(runs: int) -> list[str]:
    return [problem for i in range(runs) for problem in _run(ENDS[i % len(ENDS)])]


def test_a_ddp_engine_script_exits_cleanly() -> None:
    failures = _failures(len(ENDS))
    assert not failures, f"{len(failures)} rank(s) of {len(ENDS)} runs failed:\n" + "\n\n".join(failures[:4])


@pytest.mark.slow
@pytest.mark.timeout(900)  # (36 runs of 5-10 s, more on a loaded machine)
def test_a_ddp_engine_script_exits_cleanly_36_times() -> None:
    failures = _failures(36)
    assert not failures, f"{len(failures)} rank(s) of 36 runs failed:\n" + "\n\n".join(failures[:4])
