"""Jobs of rank processes on this machine, for scripts/gpu_nccl_check.py and scripts/bench_engine.py.

:func:`launch` starts ``world`` processes of a command with torchrun's variables (and, for NCCL with
several ranks on one GPU, each rank's NCCL variables: ``gpu_common.nccl_rank_env``), each one's output
to a log, and kills those still running at a deadline; :func:`run_case` runs one case of
scripts/gpu_nccl_ranks.py that way (``gpu_nccl_check.py rank CASE OUT_DIR ARGS_JSON``) and reads each
rank's JSON; :func:`clean_end` and :func:`nccl_said` judge and quote what the ranks did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ombench import SCRIPTS

ROOT = SCRIPTS.parent
NCCL_LINES = re.compile(r"NCCL (WARN|version)|via NET/Socket|via (P2P|SHM)|[Ee]rror|Duplicate GPU|Traceback")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, extra: dict[str, str], nccl: bool) -> dict[str, str]:
    """torchrun's variables for ``rank`` on one node, and with ``nccl`` the rank's NCCL variables
    (gpu_common.nccl_rank_env: for programs that do not set them, like examples/train_recsys.py)."""
    from gpu_common import nccl_rank_env

    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    if nccl:
        env.update(nccl_rank_env(rank))
    env.update(extra)  # (after: the caller's NCCL_DEBUG and variant win)
    env.pop("OMNIREDUCE_AGGREGATORS", None)
    return env


def wait_all(procs: list[subprocess.Popen[Any]], deadline: float) -> list[float | None]:
    """Wait for every process until ``deadline`` (time.time()); when each ended (None: still running,
    then killed)."""
    ended: list[float | None] = [None] * len(procs)
    while any(e is None for e in ended) and time.time() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if ended[i] is None:  # (each job leads a session of its own: torchrun's ranks go with it)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # (a rank stuck in the driver may linger: go on)
                p.wait(timeout=10)
    return ended


def launch(cmd: list[str], world: int, work: Path, *, env: dict[str, str] | None = None, timeout: float = 120.0,
           name: str = "job", nccl: bool = False) -> list[dict[str, Any]]:
    """``world`` processes of ``cmd`` (torchrun's variables set), each one's output to the log; per
    rank: exit status, seconds, whether it was still running at the deadline (then killed), its
    output, and when it ended."""
    work.mkdir(parents=True, exist_ok=True)
    port, t0 = free_port(), time.time()
    logs = [work / f"{name}.rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as f:
            procs.append(subprocess.Popen(cmd, env=rank_env(r, world, port, env or {}, nccl), stdout=f,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                          start_new_session=True))
    ended = wait_all(procs, t0 + timeout)
    out = []
    for r, (p, e) in enumerate(zip(procs, ended, strict=True)):
        text = logs[r].read_text(errors="replace")
        print(f"--- {name}, rank {r} of {world}: exit status {p.returncode}"
              f"{' (killed at the deadline)' if e is None else ''}\n" + "".join(f"[rank {r}] {line}\n"
                                                                                for line in text.splitlines()))
        out.append({"rank": r, "rc": p.returncode, "hung": e is None, "ended_at": e,
                    "seconds": (e or time.time()) - t0, "output": text})
    return out


def run_case(case: str, args: argparse.Namespace, world: int, extra: dict[str, Any], *,
             env: dict[str, str] | None = None, timeout: float | None = None
             ) -> tuple[list[dict], list[dict | None], Path]:
    """The ranks of ``case`` (gpu_nccl_ranks.py); per rank the launch record and its JSON (None: none
    written), with ``end`` (the seconds destroy_process_group took, or None) added to the record; and
    the folder the ranks wrote to."""
    out = Path(tempfile.mkdtemp(prefix=f"{case}-W{world}-", dir=args.work))
    case_args = {"backend": args.backend, "device": args.device, "timeout": args.pg_timeout, "out": str(out), **extra}
    cmd = [sys.executable, str(SCRIPTS / "gpu_nccl_check.py"), "rank", case, str(out), json.dumps(case_args)]
    ranks = launch(cmd, world, out, env=env, timeout=timeout or args.launch_timeout, name=f"{case}-W{world}",
                   nccl=args.backend == "nccl")
    results = []
    for r in ranks:
        f, end = out / f"rank{r['rank']}.json", out / f"rank{r['rank']}.end.json"
        results.append(json.loads(f.read_text()) if f.is_file() else None)
        r["end"] = json.loads(end.read_text())["destroy_s"] if end.is_file() else None
    return ranks, results, out


def clean_end(ranks: list[dict]) -> tuple[bool, str]:
    """Every rank exited 0 after destroy_process_group returned; the words for it."""
    bad = [r["rank"] for r in ranks if r["rc"] != 0 or r["hung"] or r["end"] is None]
    worst = max((r["end"] for r in ranks if r["end"] is not None), default=float("nan"))
    if bad:
        hung = [r["rank"] for r in ranks if r["hung"]]
        return False, f"ranks {bad} did not end cleanly (exit {[r['rc'] for r in ranks]}, hung {hung})"
    return True, f"every rank exited 0, destroy_process_group took at most {worst:.2f} s"


def nccl_said(ranks: list[dict], failed: bool) -> list[str]:
    """What NCCL printed that matters: the version, the transports, its warnings and errors; for a
    failed rank also its last 25 lines."""
    lines: list[str] = []
    for r in ranks:
        text = r["output"].splitlines()
        lines += [f"rank {r['rank']}: {s}" for s in text if NCCL_LINES.search(s)][:40]
        if failed and (r["rc"] != 0 or r["hung"]):
            lines += [f"rank {r['rank']} (tail): {s}" for s in text[-25:]]
    return lines
