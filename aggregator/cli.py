"""``omnireduce-agg``: run an aggregator until SIGINT or SIGTERM.

Prints ``omnireduce-agg listening on tcp://HOST:PORT`` (the real port when PORT is 0) on standard
output once the socket is bound and accepting connections, so a supervisor or script can wait for
that line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from omnireduce._malloc import keep_freed_memory
from omnireduce.aggregator.service import Aggregator, AggregatorLimits


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnireduce-agg",
        description="Run an omnireduce aggregator: workers stream their non-zero gradient blocks to it and "
                    "it sends back the sums. Runs until SIGINT/SIGTERM.")
    p.add_argument("--listen", default="tcp://127.0.0.1:5555",
                   help="address to bind, tcp://HOST:PORT; PORT 0 picks a free port (default: %(default)s)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the shared token workers must present (default: $OMNIREDUCE_TOKEN); "
                        "required unless listening on loopback or --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without a token")
    p.add_argument("--max-jobs", type=int, default=AggregatorLimits.max_jobs,
                   help="jobs registered at once (default: %(default)s)")
    p.add_argument("--max-slots-per-job", type=int, default=AggregatorLimits.max_slots_per_job,
                   help="tensor slots in flight per job (default: %(default)s)")
    p.add_argument("--max-message-bytes", type=int, default=AggregatorLimits.max_message_bytes,
                   help="largest message accepted, in bytes (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (default: %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    keep_freed_memory()
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as e:
            print(f"omnireduce-agg: cannot read --token-file: {e}", file=sys.stderr)
            return 2
        if not token:
            print(f"omnireduce-agg: --token-file {args.token_file} is empty", file=sys.stderr)
            return 2
    limits = AggregatorLimits(max_jobs=args.max_jobs, max_slots_per_job=args.max_slots_per_job,
                              max_message_bytes=args.max_message_bytes)
    try:
        agg = Aggregator(args.listen, token, insecure=args.insecure, limits=limits)
        address = agg.bind()
    except Exception as e:  # bad address, port in use, no token on a public address
        print(f"omnireduce-agg: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("omnireduce.aggregator").info("received %s, stopping",
                                                        signal.Signals(signum).name)
        agg._stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sys.stdout.write(f"omnireduce-agg listening on {address}\n")
    sys.stdout.flush()
    agg.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
