#!/usr/bin/env python3
"""Network emulation harness: N worker and A aggregator "hosts" on one shaped, isolated Linux network.

This is its command line (``selftest``, ``cleanup``, ``run``). The emulated network itself
(namespaces, bridge, tbf shaping, teardown) is :mod:`ombench.netem`, whose docstring
explains the design.

    python scripts/netem.py selftest --rate 1gbit        # measured throughput between two hosts
    python scripts/netem.py cleanup [--all]              # remove leftovers (default: dead owners only)
    python scripts/netem.py run --workers 2 --aggregators 1 --rate 1gbit -- w0 python -c '...'

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (``ip``, ``tc``) and kernel support for
network namespaces, veth, bridge and tbf.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Sequence

from ombench.netem import PREFIX, Cluster, available, cleanup, list_namespaces, measure_throughput


def _selftest(args: argparse.Namespace) -> int:
    with Cluster(workers=2, aggregators=1, rate=args.rate) as c:
        rate = c.rate_bps
        shaping = f"tbf rate {rate / 1e9:g} Gbit/s, burst {c.burst} B, limit {c.limit} B" if rate else "unshaped"
        print(f"cluster {c.id}: {c.subnet}, {shaping}")
        for h in c.hosts:
            print(f"  {h.label}: {h.name} {h.interface} {h.address}")
        ok = True
        pairs = [(c.workers[0], c.aggregators[0]), (c.aggregators[0], c.workers[0]), (c.workers[0], c.workers[1])]
        for src, dst in pairs:
            bps = measure_throughput(src, dst, seconds=args.seconds)
            verdict = ""
            if rate:
                frac = bps / rate
                good = 0.8 <= frac <= 1.05
                ok &= good
                verdict = f"  ({frac:.1%} of rate) {'ok' if good else 'OUT OF RANGE [80%, 105%]'}"
            print(f"  {src.label} -> {dst.label}: {bps / 1e9:.3f} Gbit/s{verdict}")
    leftovers = [n for n in list_namespaces() if n.startswith(c.id + "-")]
    if leftovers:
        print(f"teardown left namespaces behind: {leftovers}")
        ok = False
    return 0 if ok else 1


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if len(cmd) < 2:
        print("usage: netem.py run [options] -- <w0|a0|...|root> <cmd...>", file=sys.stderr)
        return 2
    where, cmd = cmd[0], cmd[1:]
    with Cluster(workers=args.workers, aggregators=args.aggregators, rate=args.rate) as c:
        for h in c.hosts:
            print(f"{h.label}: {h.name} {h.interface} {h.address}", file=sys.stderr)
        env = {**os.environ, **c.env()}
        if where == "root":
            p = subprocess.Popen(cmd, env=env)
        else:
            p = c.popen(c.host(where), cmd, env=env)
        try:
            return p.wait()
        finally:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: ``selftest``, ``cleanup``, ``run``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("-v", "--verbose", action="count", default=0, help="-v: info, -vv: every ip/tc command")
    sub = ap.add_subparsers(dest="command", required=True)
    st = sub.add_parser("selftest", help="build 2 workers + 1 aggregator and measure TCP throughput between them")
    st.add_argument("--rate", default="1gbit", help="link rate: 1gbit, 10gbit, none, ... (default 1gbit)")
    st.add_argument("--seconds", type=float, default=3.0, help="seconds of data per measurement (default 3)")
    cl = sub.add_parser("cleanup", help=f"remove leftover {PREFIX}* namespaces (and anything inside them)")
    cl.add_argument("--all", action="store_true", help="also those whose owner process is still running")
    rn = sub.add_parser("run", help="run a command inside one host of a fresh cluster (host 'root': root netns)")
    rn.add_argument("--workers", type=int, default=2)
    rn.add_argument("--aggregators", type=int, default=1)
    rn.add_argument("--rate", default="1gbit")
    rn.add_argument("cmd", nargs=argparse.REMAINDER, help="-- <w0|a0|...|root> <cmd...>")
    args = ap.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "cleanup":
        if os.geteuid() != 0:
            print("cleanup needs root", file=sys.stderr)
            return 1
        removed = cleanup(include_live=args.all)
        print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to clean up")
        return 0
    ok, why = available()
    if not ok:
        print(f"netem: cannot emulate a network here: {why}", file=sys.stderr)
        return 1
    return _selftest(args) if args.command == "selftest" else _run(args)


if __name__ == "__main__":
    sys.exit(main())
