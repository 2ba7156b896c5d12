"""``omnireduce-run``: one command to train with omnireduce on one machine.

    omnireduce-run --nproc 4 train.py [args...]
    omnireduce-run [--aggregators A] -- [torchrun options] train.py [args...]

runs the workers through torchrun, streams every worker's output with a ``[rank N]`` prefix, and
stops everything on Ctrl-C (saying so in one line) or as soon as a worker fails, exiting with the
failing worker's own exit code (torchrun alone reports 1; each worker runs under
``omnireduce.launch.child``, which records its code). After ``--``, everything goes to torchrun as given
(``--nproc-per-node``, ``--nnodes``, ``--rdzv-*``, ...); without it the run is
``torchrun --standalone --nproc-per-node N``.

Aggregators: by default omnireduce-run starts none, and the job runs its own (the DDP hook starts
one per node from the node's first rank: :mod:`omnireduce.launch.colocate`). ``--aggregators A`` starts A
dedicated ``omnireduce-agg`` processes on free loopback ports first and gives the workers their
addresses in ``OMNIREDUCE_AGGREGATORS``. An ``OMNIREDUCE_AGGREGATORS`` already set in the
environment passes through to the workers unchanged.
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

from omnireduce.launch.procs import aggregator_command, start_aggregator, stop_processes
from omnireduce.launch.settings import RUN_DIR_VAR
from omnireduce.version import __version__

_PREFIX = re.compile(r"^\[default(\d+)\]:")

_EPILOG = """examples:
  omnireduce-run --nproc 4 train.py --epochs 3
      4 workers on this machine; the job starts its own aggregator
  omnireduce-run --aggregators 2 -- --nproc-per-node 4 --master-port 29600 train.py --epochs 3
      2 dedicated local aggregators; torchrun options after --, then the script and its arguments

The script initialises torch.distributed as under torchrun (RANK, WORLD_SIZE, ... are set) and
registers the hook: model.register_comm_hook(OmniReduceState(), omnireduce_hook).
Exit status: 0, the failing worker's own code, 130 after Ctrl-C, 2 for bad arguments."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnireduce-run", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --nproc N [options] script.py [args ...]\n"
              "       %(prog)s [options] -- [torchrun options] script.py [args ...]",
        description="Run a training script on this machine with N workers (through torchrun). The job starts "
                    "its own omnireduce aggregator; with --aggregators A, A dedicated local aggregators are "
                    "started first and OMNIREDUCE_AGGREGATORS is set for the workers.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--nproc", type=int, default=None,
                   help="number of worker processes (torchrun --standalone --nproc-per-node N)")
    p.add_argument("--aggregators", type=int, default=None, metavar="A",
                   help="start A dedicated local aggregators and set OMNIREDUCE_AGGREGATORS for the workers "
                        "(default: none; the job runs its own, colocated with the workers)")
    p.add_argument("--agg-log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="the dedicated aggregators' log level (default: %(default)s)")
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def torchrun_command(nproc: int | None, passthrough: list[str] | None, script: str | None,
                     script_args: list[str]) -> tuple[list[str], str]:
    """The torchrun command line that runs every worker under ``omnireduce.launch.child``, and the script.

    ``passthrough`` (what followed ``--``) is torchrun's own command line, script included: torchrun's
    parser finds where its options end. ValueError says what is wrong with the arguments."""
    child = ["-m", "omnireduce.launch.child"]
    launcher = [sys.executable, "-m", "torch.distributed.run"]
    if passthrough is None:
        if nproc is None or script is None:
            raise ValueError("give --nproc N and the script (or torchrun options after --)")
        return [*launcher, "--standalone", f"--nproc-per-node={nproc}", "--tee=3", *child, script,
                *script_args], script
    if nproc is not None or script is not None:
        raise ValueError("after --, give torchrun's own options and the script there (--nproc-per-node "
                         "instead of --nproc)")
    from torch.distributed.run import get_args_parser

    try:
        parsed = get_args_parser().parse_args(passthrough)
    except SystemExit:
        raise ValueError(f"torchrun cannot parse the options after --: {' '.join(passthrough)}") from None
    if parsed.module or parsed.no_python:
        raise ValueError("omnireduce-run runs a script file: drop torchrun's -m / --no-python")
    options = passthrough[: len(passthrough) - 1 - len(parsed.training_script_args)]
    return [*launcher, *options, "--tee=3", *child, parsed.training_script, *parsed.training_script_args], \
        parsed.training_script


def _pump(stream: IO[str], out: IO[str], rewrite: bool, tag: str = "", mute: threading.Event | None = None) -> None:
    """Copy ``stream`` to ``out`` line by line (``[defaultN]:`` becomes ``[rank N]``); drop lines once ``mute``."""
    for line in stream:
        if mute is not None and mute.is_set():
            continue
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
            p, address = start_aggregator(aggregator_command("tcp://127.0.0.1:0", log_level=level),
                                          name=f"aggregator {i}", stderr=subprocess.PIPE)
            procs.append(p)
            addresses.append(address)
            threading.Thread(target=_pump, args=(p.stderr, sys.stderr, False, f"[agg {i}] "), daemon=True).start()
    except BaseException:
        stop_processes(procs)
        raise
    return procs, addresses


def _failing_code(run_dir: Path) -> int | None:
    """The exit code of the worker that failed first, from the files omnireduce.launch.child wrote."""
    found = []
    for f in run_dir.glob("exit-*"):
        code, stamp = f.read_text().split()
        found.append((float(stamp), int(code)))
    return min(found)[1] if found else None


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]] | int:
    """The arguments and torchrun's command line, or the exit status after saying what is wrong."""
    passthrough = None
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    if (args.nproc is not None and args.nproc < 1) or (args.aggregators is not None and args.aggregators < 1):
        print("omnireduce-run: --nproc and --aggregators must be >= 1", file=sys.stderr)
        return 2
    try:
        cmd, script = torchrun_command(args.nproc, passthrough, args.script, args.args)
    except ValueError as e:
        print(f"omnireduce-run: {e}", file=sys.stderr)
        return 2
    if not Path(script).is_file():
        print(f"omnireduce-run: no such script: {script}", file=sys.stderr)
        return 2
    return args, cmd


def _supervise(cmd: list[str], env: dict[str, str], aggs: list[subprocess.Popen[str]],
               stopping: threading.Event) -> int:
    """Run torchrun, pass its output on and stop it (and ``aggs``) on SIGINT/SIGTERM; its exit status."""
    torchrun = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGTERM)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    # After Ctrl-C, what torchrun and the workers print while they die (torchrun's SignalException
    # traceback, the workers' KeyboardInterrupt) says nothing new: one line says it instead.
    pumps = [threading.Thread(target=_pump, args=(torchrun.stdout, sys.stdout, True, "", stopping), daemon=True),
             threading.Thread(target=_pump, args=(torchrun.stderr, sys.stderr, True, "", stopping), daemon=True)]
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
    return rc


def main(argv: list[str] | None = None) -> int:
    parsed = _parse(list(sys.argv[1:] if argv is None else argv))
    if isinstance(parsed, int):
        return parsed
    args, cmd = parsed
    aggs: list[subprocess.Popen[str]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.aggregators is not None:
        try:
            aggs, addresses = _start_aggregators(args.aggregators, args.agg_log_level)
        except Exception as e:
            print(f"omnireduce-run: {e}", file=sys.stderr)
            return 1
        env["OMNIREDUCE_AGGREGATORS"] = ",".join(addresses)
    stopping = threading.Event()
    with tempfile.TemporaryDirectory(prefix="omnireduce-run-") as run_dir:
        env[RUN_DIR_VAR] = run_dir
        rc = _supervise(cmd, env, aggs, stopping)
        if stopping.is_set():
            also = f" and {len(aggs)} aggregator(s)" if aggs else ""
            print(f"omnireduce-run: interrupted; stopped the workers{also}", file=sys.stderr)
            return 130
        if rc == 0:
            return 0
        code = _failing_code(Path(run_dir))
        return code if code is not None else (rc if rc > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
