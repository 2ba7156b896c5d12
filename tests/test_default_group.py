"""torch's own defaults must not keep the program's default process group alive
(:mod:`omnireduce.default_group`): ``torch.distributed.nn.functional``, imported by ``torch.profiler``
once a group exists, holds it in its functions' default arguments, so ``destroy_process_group()``
cannot free it and its Gloo threads live into the interpreter's shutdown (plain torch 2.13 aborted
there in 8 of 20 two-rank runs of a profiled script, docs/reference/reliability.md).

Checked deterministically in fresh interpreters (whether the group is freed), and by the exit of a
profiled two-rank script: ``make test`` runs it once each way, ``make exit-loop`` 40 times."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from omnireduce.launch.procs import free_port
from tests.exit_runs import two_ranks
from tests.harness import own_output

SCRIPT = str(Path(__file__).parent / "scripts" / "profiler_exit.py")

_HELD = """
import gc, sys, weakref
import torch, torch.distributed as dist
order = sys.argv[2]
if order == "before":
    import omnireduce.engines.collective
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
if order == "after":
    import omnireduce.engines.collective
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU]):
    dist.all_reduce(torch.ones(1))
world = weakref.ref(dist.group.WORLD)
import torch.distributed.nn.functional as F
held_by_defaults = F.all_reduce.__defaults__[-1] is world()
from omnireduce import default_group
kept = default_group.let_go()  # (the group still torch's default: left alone)
dist.destroy_process_group()
gc.collect()
destroyed = "freed" if world() is None else "held"
let_go = default_group.let_go()
gc.collect()
print(held_by_defaults, kept, destroyed, let_go, "freed" if world() is None else "held")
"""


def _held(order: str) -> list[str]:
    p = subprocess.run([sys.executable, "-c", _HELD, str(free_port()), order], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return own_output(p.stdout).split()


def test_imported_before_the_group_torch_defaults_hold_none() -> None:
    """omnireduce imported first: the profiler's import finds the module there, its defaults None; the
    group is freed by destroy_process_group() itself, and there is nothing to let go of."""
    assert _held("before") == ["False", "0", "freed", "0", "freed"]


def test_imported_after_the_group_its_defaults_are_let_go_once_destroyed() -> None:
    """omnireduce imported after init_process_group: the defaults hold the group (torch's behaviour,
    shown), let_go leaves it while it is torch's default, and frees it once destroyed."""
    held_by_defaults, kept, destroyed, let_go, after = _held("after")
    assert (held_by_defaults, kept, destroyed) == ("True", "0", "held"), (held_by_defaults, kept, destroyed)
    assert int(let_go) > 0 and after == "freed", (let_go, after)


def _failures(runs: int) -> list[str]:
    orders = ("after", "before")
    return [problem for i in range(runs)
            for problem in two_ranks(SCRIPT, [orders[i % 2]], ["reductions 4", "world freed"], orders[i % 2])]


def test_a_profiled_script_exits_cleanly() -> None:
    failures = _failures(2)
    assert not failures, f"{len(failures)} rank(s) of 2 runs failed:\n" + "\n\n".join(failures[:4])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_profiled_script_exits_cleanly_40_times() -> None:
    failures = _failures(40)
    assert not failures, f"{len(failures)} rank(s) of 40 runs failed:\n" + "\n\n".join(failures[:4])
