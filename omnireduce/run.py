"""``omnireduce-run``: one command to train with omnireduce on one machine.

    omnireduce-run --nproc 4 [--aggregators 1] train.py [args...]

starts the aggregators (``omnireduce-agg`` processes on free loopback ports), then the ``--nproc``
workers through torchrun with ``OMNIREDUCE_AGGREGATORS`` set, streams every worker's output with a
``[rank N]`` prefix, and stops everything on Ctrl-C or as soon as a worker fails, exiting with the
failing worker's own exit code (torchrun alone reports 1; each worker runs under
``omnireduce._child``, which records its code). On a cluster, run ``omnireduce-agg`` on the
aggregator hosts and torchrun on the worker hosts instead.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

from omnireduce.procs import start_aggregator, stop_processes

_PREFIX = re.compile(r"^\[default(\d+)\]:")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnireduce-run",
        description="Run a training script on this machine with N workers (through torchrun) and A local "
                    "omnireduce aggregators; OMNIREDUCE_AGGREGATORS is set for the workers.")
    p.add_argument("--nproc", type=int, required=True, help="number of worker processes")
    p.add_argument("--aggregators", type=int, default=1, help="number of local aggregators (default: %(default)s)")
    p.add_argument("--agg-log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="aggregators' log level (default: %(default)s)")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _pump(stream: IO[str], out: IO[str], rewrite: bool, tag: str = "") -> None:
    for line in stream:
        if rewrite:
            line = _PREFIX.sub(lambda m: f"[rank {m.group(1)}] ", line)
        out.write(tag + line)
        out.flush()


def _start_aggregators(n: int, level: str) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """Start ``n`` aggregators on free loopback ports; on any failure, stop those already started."""
    procs: list[subprocess.Popen[str]] = []
    addresses = []
    try:
        for i in range(n):
            p, address = start_aggregator([sys.executable, "-m", "omnireduce.aggregator.cli", "--listen",
                                           "tcp://127.0.0.1:0", "--log-level", level],
                                          name=f"aggregator {i}", stderr=subprocess.PIPE)
            procs.append(p)
            addresses.append(address)
            threading.Thread(target=_pump, args=(p.stderr, sys.stderr, False, f"[agg {i}] "), daemon=True).start()
    except BaseException:
        stop_processes(procs)
        raise
    return procs, addresses


def _failing_code(run_dir: Path) -> int | None:
    """The exit code of the worker that failed first, from the files omnireduce._child wrote."""
    found = []
    for f in run_dir.glob("exit-*"):
        code, stamp = f.read_text().split()
        found.append((float(stamp), int(code)))
    return min(found)[1] if found else None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.nproc < 1 or args.aggregators < 1:
        print("omnireduce-run: --nproc and --aggregators must be >= 1", file=sys.stderr)
        return 2
    if not Path(args.script).is_file():
        print(f"omnireduce-run: no such script: {args.script}", file=sys.stderr)
        return 2
    try:
        aggs, addresses = _start_aggregators(args.aggregators, args.agg_log_level)
    except Exception as e:
        print(f"omnireduce-run: {e}", file=sys.stderr)
        return 1
    stopping = threading.Event()
    with tempfile.TemporaryDirectory(prefix="omnireduce-run-") as run_dir:
        env = dict(os.environ, OMNIREDUCE_AGGREGATORS=",".join(addresses), OMNIREDUCE_RUN_DIR=run_dir,
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "--tee=3", "-m", "omnireduce._child", args.script, *args.args]
        torchrun = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)

        def on_signal(signum: int, _frame: object) -> None:
            stopping.set()
            if torchrun.poll() is None:
                os.killpg(torchrun.pid, signal.SIGTERM)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        pumps = [threading.Thread(target=_pump, args=(torchrun.stdout, sys.stdout, True), daemon=True),
                 threading.Thread(target=_pump, args=(torchrun.stderr, sys.stderr, True), daemon=True)]
        for t in pumps:
            t.start()
        try:
            try:
                rc = torchrun.wait()
            except KeyboardInterrupt:
                on_signal(signal.SIGINT, None)
                rc = torchrun.wait()
            for t in pumps:
                t.join(5)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            if torchrun.poll() is None:
                os.killpg(torchrun.pid, signal.SIGKILL)
            stop_processes(aggs)
        if stopping.is_set():
            return 130
        if rc == 0:
            return 0
        code = _failing_code(Path(run_dir))
        return code if code is not None else (rc if rc > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
