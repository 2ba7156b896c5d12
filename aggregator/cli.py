"""``omnireduce-agg``: run an aggregator until SIGINT or SIGTERM.

Prints ``omnireduce-agg listening on tcp://HOST:PORT`` (the real port when PORT is 0) on standard
output once the socket is bound and accepting connections, so a supervisor or script can wait for
that line.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from omnireduce._malloc import keep_freed_memory
from omnireduce.aggregator.limits import AggregatorLimits
from omnireduce.aggregator.service import DEFAULT_IO_THREADS, Aggregator
from omnireduce.credentials import check_curve_key
from omnireduce.version import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnireduce-agg",
        description="Run an omnireduce aggregator: workers stream their non-zero gradient blocks to it and "
                    "it sends back the sums. Runs until SIGINT/SIGTERM.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--listen", default="tcp://127.0.0.1:5555",
                   help="address to bind, tcp://HOST:PORT; PORT 0 picks a free port (default: %(default)s)")
    p.add_argument("--token-file", type=Path, default=None,
                   help="file holding the shared token workers must present; without it the token is "
                        "$OMNIREDUCE_TOKEN (the token itself) or the file $OMNIREDUCE_TOKEN_FILE names. A token "
                        "is required unless listening on loopback or --insecure")
    p.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without a token")
    p.add_argument("--curve-secret-key-file", type=Path, default=None,
                   help="encrypt every connection with zmq CURVE using this server secret key (Z85); workers "
                        "need the matching public key: OMNIREDUCE_CURVE_SERVER_KEY_FILE=<the .pub file> (or the "
                        "key itself in OMNIREDUCE_CURVE_SERVER_KEY)")
    p.add_argument("--curve-keygen", type=Path, default=None, metavar="PATH",
                   help="write a new CURVE key pair to PATH (secret) and PATH.pub (public), then exit")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (needs prometheus-client)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (default: %(default)s)")
    p.add_argument("--socket-buffer", type=int, default=0,
                   help="TCP send/receive buffer per connection in bytes; 0 leaves the kernel's autotuning "
                        "(default: %(default)s). A small one limits incast into shallow switch buffers")
    p.add_argument("--io-threads", type=int, default=DEFAULT_IO_THREADS,
                   help="libzmq I/O threads; the workers' connections (and the kernel's TCP copies) are spread "
                        "over them (default: %(default)s)")
    p.add_argument("--log-interval", type=float, default=60.0,
                   help="seconds between status log lines; 0 for none (default: %(default)s)")
    p.add_argument("--max-jobs", type=int, default=AggregatorLimits.max_jobs,
                   help="jobs registered at once (default: %(default)s)")
    p.add_argument("--max-peers", type=int, default=AggregatorLimits.max_peers,
                   help="worker connections registered at once (default: %(default)s)")
    p.add_argument("--max-job-bytes", type=int, default=AggregatorLimits.max_job_bytes,
                   help="bytes a job's tensors in flight may hold (default: %(default)s)")
    p.add_argument("--max-total-bytes", type=int, default=AggregatorLimits.max_total_bytes,
                   help="bytes all jobs' tensors in flight may hold together (default: %(default)s)")
    p.add_argument("--max-slots-per-job", type=int, default=AggregatorLimits.max_slots_per_job,
                   help="tensor slots in flight per job (default: %(default)s)")
    p.add_argument("--max-message-bytes", type=int, default=AggregatorLimits.max_message_bytes,
                   help="largest message accepted, in bytes (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="logging level (default: %(default)s)")
    p.add_argument("--check", metavar="ADDRESS", default=None,
                   help="health probe: ask the aggregator at ADDRESS (tcp://HOST:PORT) a question, exit 0 if "
                        "its loop answers, 1 otherwise, printing one line; with CURVE, give "
                        "--curve-secret-key-file or OMNIREDUCE_CURVE_SERVER_KEY")
    p.add_argument("--check-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long --check waits for the answer (default: %(default)s)")
    return p


def main(argv: list[str] | None = None, on_serving: Callable[[Aggregator], None] | None = None) -> int:
    """Run ``omnireduce-agg`` with ``argv``; ``on_serving(aggregator)`` is called once it listens."""
    args = build_parser().parse_args(argv)
    if args.check is not None:
        from omnireduce.aggregator.health import run_check

        return run_check(args.check, args.check_timeout, args.curve_secret_key_file)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    if args.curve_keygen is not None:
        return _keygen(args.curve_keygen)
    keep_freed_memory()
    made = _make_aggregator(args)
    if isinstance(made, int):
        return made
    agg, address = made
    return _serve(agg, address, on_serving)


def _read_token(token_file: Path | None) -> str | None:
    """The token in ``--token-file`` (None without one); ValueError saying why it cannot be used."""
    if token_file is None:
        return None
    try:
        token = token_file.read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read --token-file: {e}") from None
    if not token:
        raise ValueError(f"--token-file {token_file} is empty")
    return token


def _make_aggregator(args: argparse.Namespace) -> tuple[Aggregator, str] | int:
    """The aggregator the arguments describe, bound, and its address; or exit status 2 after saying why not."""
    try:
        token = _read_token(args.token_file)
    except ValueError as e:
        print(f"omnireduce-agg: {e}", file=sys.stderr)
        return 2
    limits = AggregatorLimits(max_jobs=args.max_jobs, max_peers=args.max_peers,
                              max_slots_per_job=args.max_slots_per_job, max_job_bytes=args.max_job_bytes,
                              max_total_bytes=args.max_total_bytes,
                              max_message_bytes=args.max_message_bytes)
    try:
        secret = args.curve_secret_key_file.read_text().strip() if args.curve_secret_key_file else None
        check_curve_key(secret, str(args.curve_secret_key_file), "secret")
        agg = Aggregator(args.listen, token, insecure=args.insecure, limits=limits, curve_secret_key=secret,
                         log_interval=args.log_interval, socket_buffer=args.socket_buffer,
                         io_threads=args.io_threads)
        address = agg.bind()
        if args.metrics_port is not None:
            port = agg.telemetry.serve_metrics(args.metrics_port, args.metrics_host, agg.gauges)
            logging.getLogger("omnireduce.aggregator").info("metrics on http://%s:%d/metrics", args.metrics_host,
                                                            port)
    except Exception as e:  # bad address, port in use, no token on a public address, bad key
        print(f"omnireduce-agg: {e}", file=sys.stderr)
        return 2
    return agg, address


def _serve(agg: Aggregator, address: str, on_serving: Callable[[Aggregator], None] | None) -> int:
    """Serve until SIGINT/SIGTERM, saying the address on standard output once listening."""
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only flags: a handler runs between any two bytecodes of the main thread, maybe inside a lock
        # that logging or an Event would take again (a second SIGTERM deadlocked the loop that way).
        received.append(signum)
        agg.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    sys.stdout.write(f"omnireduce-agg listening on {address}\n")
    sys.stdout.flush()
    if on_serving is not None:
        on_serving(agg)
    agg.serve_forever()
    # Already leaving: a SIGTERM sent together with the first must not kill the process while it ends
    # (Python puts back the default action, death by the signal, when it finalizes).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log = logging.getLogger("omnireduce.aggregator")
    if received:
        log.info("received %s, stopped", signal.Signals(received[0]).name)
    return 0


def _keygen(path: Path) -> int:
    import zmq

    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # never readable by others
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # also when the file existed with wider permissions
        f.write(secret + b"\n")
    path.with_name(path.name + ".pub").write_bytes(public + b"\n")
    print(f"wrote {path} (secret: for --curve-secret-key-file) and {path}.pub (public: for workers' "
          f"OMNIREDUCE_CURVE_SERVER_KEY_FILE={path}.pub)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
