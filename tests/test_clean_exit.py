"""A job's end as a user sees it: the README's script (no close() anywhere) under real torchrun, on one
node of 2 ranks, on 2 nodes of 1 rank (two torchrun invocations sharing a c10d rendezvous) and with
fuse_optimizer. Every run must exit 0, print no warning or error, leave no omnireduce thread alive
when the interpreter shuts down, and leave no process behind. The quick version runs each layout
once (two nodes in ``make test-e2e``); the slow one 100 times (``make exit-loop``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from omnireduce.launch.procs import free_port

SCRIPT = str(Path(__file__).parent / "scripts" / "readme_exit.py")
# anything a user would read as trouble; torchrun's own banner is silenced by OMP_NUM_THREADS
TROUBLE = re.compile(r"warn|error|lost the connection|abort|terminate|ignored|traceback|leftover|signal",
                     re.IGNORECASE)
LAYOUTS = {"one-node": (1, []), "two-nodes": (2, []), "fused": (1, ["--fuse"])}


def _left_behind(marker: str) -> list[str]:
    """Processes whose environment carries this run's marker (the torchruns, ranks, aggregators)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("OMNIREDUCE_EXIT_TEST") == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])}")
        except (psutil.Error, OSError):
            continue
    return out


def run_job(nodes: int, args: list[str], timeout: float = 120.0) -> tuple[list[int], str, list[str]]:
    """One job: ``nodes`` torchrun invocations of 2 // nodes ranks each. Returns the exit codes, the
    output of all of them, and the processes still alive a moment after the last one ended."""
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", OMNIREDUCE_EXIT_TEST=marker, PYTHONUNBUFFERED="1")
    for k in ("OMNIREDUCE_AGGREGATORS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
              "MASTER_PORT"):
        env.pop(k, None)
    run = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        cmds = [[*run, "--standalone", "--nproc-per-node", "2", SCRIPT, *args]]
    else:
        rdzv = ["--nnodes", str(nodes), "--nproc-per-node", str(2 // nodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", marker]
        cmds = [[*run, *rdzv, SCRIPT, *args] for _ in range(nodes)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outputs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            p.kill()
    time.sleep(0.5)
    left = _left_behind(marker)
    for pid_cmd in left:  # leave none behind for the next test either
        psutil.Process(int(pid_cmd.split(":")[0])).kill()
    return codes, "\n".join(outputs), left


def _check(layout: str) -> None:
    nodes, args = LAYOUTS[layout]
    codes, out, left = run_job(nodes, args)
    assert codes == [0] * nodes, f"{layout}: exit codes {codes}\n{out[-4000:]}"
    trouble = [line for line in out.splitlines() if TROUBLE.search(line)]
    assert not trouble, f"{layout}: the output says\n" + "\n".join(trouble[:20])
    assert not left, f"{layout}: left behind {left}"


# two nodes: two torchruns and a c10d rendezvous, the slowest layout: make test-e2e
@pytest.mark.parametrize("layout", [pytest.param(x, marks=[pytest.mark.e2e] if x == "two-nodes" else [])
                                    for x in sorted(LAYOUTS)])
def test_readme_script_ends_cleanly(layout: str) -> None:
    _check(layout)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # (100 jobs of ~7 s)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_readme_script_ends_cleanly_100_times(layout: str) -> None:
    failures = []
    for i in range(100):
        try:
            _check(layout)
        except AssertionError as e:
            failures.append(f"run {i}: {e}")
    assert not failures, f"{len(failures)} of 100 runs failed:\n" + "\n\n".join(failures[:3])
