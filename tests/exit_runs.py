"""Two rank processes of a test script run to their end: what went wrong on each (the exit tests').

A rank went wrong where it exited non-zero, printed other lines than the test wants, or said anything
on stderr that looks like trouble (an abort's "terminate called", a warning, a traceback)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from omnireduce.launch.procs import free_port
from tests.harness import own_output

TROUBLE = re.compile(r"terminate|abort|warn|error|traceback|ignored|signal|fatal", re.IGNORECASE)
_LAUNCHERS = ("OMNIREDUCE_AGGREGATORS", "OMNIREDUCE_JOB", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
              "MASTER_PORT")


def two_ranks(script: str, args: list[str], want: list[str], label: str, timeout: float = 120.0) -> list[str]:
    """Run ``script PORT RANK *args`` as ranks 0 and 1 (no launcher's variables): what went wrong on each
    rank, named ``label`` (empty: nothing)."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    for k in _LAUNCHERS:
        env.pop(k, None)
    procs = [subprocess.Popen([sys.executable, script, port, str(rank), *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    problems = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        said = own_output(out).split("\n")[:-1]
        trouble = [line for line in err.splitlines() if TROUBLE.search(line)]
        if p.returncode != 0 or trouble or said != want:
            problems.append(f"{label}, rank {rank}: exit code {p.returncode}, stdout {said} (want {want})\n" +
                            "\n".join((trouble or err.splitlines())[-12:]))
    return problems
