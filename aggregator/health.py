"""A health probe for a running aggregator: ``omnireduce-agg --check tcp://HOST:PORT``.

An open TCP port says little: a process whose event loop is stuck still accepts connections (the
kernel completes the handshake). So the probe asks the aggregator something and waits for the
answer: it connects a DEALER socket, sends a QUERY without having said HELLO, and expects the
ERROR reply "unknown job handle" that the loop sends to any sender it does not know. Getting it
proves that the port is open, that an omnireduce aggregator speaking this wire version is behind
it, and that its loop is turning. The probe registers nothing (no job, no peer), so it can be
called as often as a container runtime or Kubernetes likes; each call is a fresh connection, so the
aggregator's per-connection error rate limit never silences it.

With CURVE the probe needs the aggregator's public key (the caller passes it; the CLI derives it
from ``--curve-secret-key-file`` or reads ``OMNIREDUCE_CURVE_SERVER_KEY``), and uses a throwaway
client key pair.
"""

from __future__ import annotations

import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq

from omnireduce.credentials import check_curve_key, env_secret
from omnireduce.errors import WireError
from omnireduce.wire import Bare, ErrorCode, Header, MsgType, decode, encode, unpack_header

DEFAULT_TIMEOUT = 5.0


@dataclass(frozen=True)
class Health:
    """The outcome of one probe: ``ok``, and one line saying why."""

    ok: bool
    message: str


def check(address: str, timeout: float = DEFAULT_TIMEOUT, *, curve_server_key: str | None = None) -> Health:
    """Probe the aggregator at ``address`` (``tcp://HOST:PORT`` or ``ipc://PATH``) within ``timeout`` seconds."""
    start = time.monotonic()
    deadline = start + timeout
    if address.startswith("tcp://"):
        refused = _tcp_connect(address, timeout)
        if refused is not None:
            return Health(False, refused)
    elif not address.startswith(("ipc://", "inproc://")):
        return Health(False, f"{address}: not an address the probe understands (tcp://HOST:PORT or ipc://PATH)")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT as well; IPv4 addresses work either way
        if curve_server_key is not None:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = curve_server_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        try:
            sock.connect(address)
        except zmq.ZMQError as e:
            return Health(False, f"{address}: cannot connect: {e}")
        sock.send_multipart(encode(Bare(Header(MsgType.QUERY))))
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(max(1, int(left * 1000))):
                break
            frames = sock.recv_multipart()
            return _judge(address, frames, time.monotonic() - start)
        hint = " (does it use CURVE? then the probe needs its public key)" if curve_server_key is None else ""
        return Health(False, f"{address}: no answer within {timeout:g} s: its loop is stuck, the connection "
                             f"was refused at the zmq level, or it is not an omnireduce aggregator{hint}")
    finally:
        sock.close(0)
        ctx.term()


def _judge(address: str, frames: list[bytes], elapsed: float) -> Health:
    try:
        hdr = unpack_header(frames[0])
        msg = decode(hdr, frames[1:])
    except (WireError, IndexError) as e:
        return Health(False, f"{address}: answered, but not as an omnireduce aggregator: {e}")
    code = getattr(msg, "code", None)
    if hdr.mtype is MsgType.ERROR and code is ErrorCode.UNKNOWN_JOB:
        return Health(True, f"{address}: healthy (answered in {elapsed * 1e3:.1f} ms)")
    return Health(False, f"{address}: unexpected answer {hdr.mtype.name}"
                         f"{f' {code.name}' if code is not None else ''} to a probe")


def _tcp_connect(address: str, timeout: float) -> str | None:
    """None if a TCP connection to ``address`` opens within ``timeout``, else why not (a clearer
    message than zmq's silence when nothing listens)."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except ValueError as e:
        return f"{address}: {e}"
    if not host or port is None:
        return f"{address}: expected tcp://HOST:PORT"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return f"{address}: cannot connect: {e.strerror or e}"


def run_check(address: str, timeout: float = DEFAULT_TIMEOUT, curve_secret_key_file: Path | None = None) -> int:
    """``omnireduce-agg --check``: print one line, return 0 when healthy, 1 otherwise.

    The aggregator's CURVE public key is derived from ``curve_secret_key_file`` when given (the probe
    runs beside the aggregator with the same files), else read from ``OMNIREDUCE_CURVE_SERVER_KEY``
    (or ``..._FILE``)."""
    try:
        if curve_secret_key_file is not None:
            secret = curve_secret_key_file.read_text().strip()
            check_curve_key(secret, str(curve_secret_key_file), "secret")
            server_key: str | None = zmq.curve_public(secret.encode()).decode()
        else:
            server_key = env_secret("OMNIREDUCE_CURVE_SERVER_KEY")
            check_curve_key(server_key, "OMNIREDUCE_CURVE_SERVER_KEY", "public")
        health = check(address, timeout, curve_server_key=server_key)
    except (OSError, ValueError) as e:
        health = Health(False, f"{address}: {e}")
    print(f"omnireduce-agg --check: {health.message}", file=sys.stdout if health.ok else sys.stderr, flush=True)
    return 0 if health.ok else 1
