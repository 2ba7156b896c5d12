"""Colocated aggregators: the job runs its own, on the worker nodes, with nothing to deploy.

:func:`start_colocated` is collective over a ``torch.distributed`` process group: every rank calls
it, and every rank gets the same :class:`Colocated` (aggregator addresses in node order, and the
token). It takes two all-gathers through the group:

1. Every rank says which node it is on; rank 0 adds a fresh random token (``secrets``). A node is a
   host, or under torchrun the node rank (``GROUP_RANK``), so that several "nodes" can share one
   machine. The node's leader is its lowest rank.
2. Each leader starts ``OMNIREDUCE_AGGREGATORS_PER_NODE`` (default 1) aggregator processes,
   listening on the node's address that the other nodes reach (the interface that routes to
   ``MASTER_ADDR``, or ``OMNIREDUCE_IFNAME``; loopback when every rank is on one node) on a free
   port (with ``OMNIREDUCE_SOCKET_BUFFER``, the workers' setting, as ``--socket-buffer``; these
   variables are read by :mod:`omnireduce.launch.settings`, which names a bad value), and
   every rank says what it started or why it could not. Every rank then lists the
   addresses in node order, or raises :class:`~omnireduce.OmniReduceError` naming the node that
   failed and why: no rank is left waiting.

The token reaches the aggregators through their environment, never their command line (which
``ps`` shows to every user). Each aggregator runs as ``python -m omnireduce.aggregator.colocated``
(its command line from :func:`omnireduce.launch.procs.aggregator_command`), which exits when its standard
input reaches end-of-file, i.e. when the process that started it is gone, however it died (SIGKILL
included): no orphans. Its log lines are passed on to this process's logger
``omnireduce.colocated`` with a ``[omnireduce-agg <node>]`` prefix. Two jobs on the same machines
get different ports and tokens, so they never see each other's traffic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any

from omnireduce.errors import OmniReduceError
from omnireduce.exits import STOP, at_exit
from omnireduce.launch.procs import COLOCATED_MODULE, aggregator_command, start_aggregator, stop_processes
from omnireduce.launch.settings import env_aggregators_per_node, env_ifname, env_socket_buffer
from omnireduce.lifetime import DEFAULT_DRAIN as DRAIN
from omnireduce.placement import node_name

log = logging.getLogger("omnireduce.colocated")

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
           "CRITICAL": logging.CRITICAL}


@dataclasses.dataclass
class Colocated:
    """The colocated aggregators of a job, as every rank sees them.

    ``addresses``: every node's aggregators, in node order (the same list on every rank);
    ``token``: the job's token (pass it to :class:`omnireduce.Worker`); ``node``: this rank's node;
    ``processes``: the aggregators this rank started (only a node's leader starts any).
    :meth:`close` stops those; it also runs at interpreter exit.
    """

    addresses: list[str]
    token: str
    node: str
    processes: list[subprocess.Popen[str]] = dataclasses.field(default_factory=list)
    log_threads: list[threading.Thread] = dataclasses.field(default_factory=list)  # (each ends with its process)

    def close(self, *, drain: bool = True) -> None:
        """Stop the aggregators this process started. Idempotent.

        With ``drain`` (a normal end), each stops once every worker of the job has left it, and
        ``DRAIN`` seconds at the latest (its own deadline; this waits that long and 5 s more before
        SIGTERM, then 5 s before SIGKILL); without, at once (SIGTERM)."""
        procs, self.processes = self.processes, []
        for p in procs:
            if p.stdin is not None:  # end-of-file: the aggregator drains and stops by itself
                p.stdin.close()
        if drain:
            deadline = time.monotonic() + DRAIN + 5.0
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        stop_processes(procs, grace=5.0)
        threads, self.log_threads = self.log_threads, []
        for t in threads:  # the aggregators' last log lines are passed on before this returns
            t.join(2.0)
        for p in procs:
            _close_pipes(p)

    def __enter__(self) -> Colocated:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reachable_host(single_node: bool) -> str:
    """The address of this node that the other nodes reach: ``OMNIREDUCE_IFNAME``'s, else the one
    that routes to ``MASTER_ADDR``, else the host name's; loopback when the job is on one node."""
    ifname = env_ifname()
    if ifname:
        return interface_address(ifname)
    if single_node:
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((master, int(os.environ.get("MASTER_PORT") or 29500)))  # no packet is sent
                return str(s.getsockname()[0])
        except OSError as e:
            raise OmniReduceError(f"cannot find the interface that routes to MASTER_ADDR={master}: {e}; set "
                                  "OMNIREDUCE_IFNAME to the interface the other nodes reach") from None
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise OmniReduceError(f"cannot resolve this host's name ({e}); set OMNIREDUCE_IFNAME") from None


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (Linux)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
        except OSError as e:
            raise OmniReduceError(f"OMNIREDUCE_IFNAME={ifname}: no IPv4 address on that interface ({e})") from None
    return socket.inet_ntoa(packed[20:24])


def start_colocated(group: Any = None, *, per_node: int | None = None, timeout: float = 60.0) -> Colocated:
    """Start this job's colocated aggregators (collective: every rank of ``group`` calls it).

    ``group``: a ``torch.distributed`` process group (None: the default one); ``per_node``:
    aggregators per node (None: ``$OMNIREDUCE_AGGREGATORS_PER_NODE`` or 1); ``timeout``: seconds an
    aggregator may take to start. Returns the same addresses and token on every rank; raises
    :class:`~omnireduce.OmniReduceError` on every rank if some node's aggregator could not start.

        import omnireduce
        from omnireduce.colocate import start_colocated

        with start_colocated() as aggs:        # after dist.init_process_group(...)
            w = omnireduce.Worker(aggs.addresses, rank=dist.get_rank(), world_size=dist.get_world_size(),
                                  token=aggs.token, job="my-run")
    """
    import torch.distributed as dist

    if per_node is None:
        per_node = env_aggregators_per_node()
    if per_node < 1:
        raise ValueError(f"aggregators per node must be >= 1, got {per_node}")
    rank = dist.get_rank(group)
    node = node_name()
    token = secrets.token_hex(16) if rank == 0 else None
    who: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(who, (node, token), group=group)
    token = who[0][1]
    nodes = list(dict.fromkeys(n for n, _ in who))  # in order of each node's lowest rank
    leader = next(r for r, (n, _) in enumerate(who) if n == node) == rank
    started: list[subprocess.Popen[str]] = []
    log_threads: list[threading.Thread] = []
    mine: tuple[list[str], str | None] = ([], None)
    if leader:
        try:
            host = reachable_host(len(nodes) == 1)
            for i in range(per_node):
                proc, address, thread = _start_one(host, token, node + (f"/{i}" if per_node > 1 else ""), timeout)
                started.append(proc)
                log_threads.append(thread)
                mine[0].append(address)
        except Exception as e:  # every rank must hear of it, not only this one
            mine = ([], f"{type(e).__name__}: {e}" if not isinstance(e, OmniReduceError) else str(e))
            _stop(started)
            started = []
    result: list[Any] = [None] * len(who)
    dist.all_gather_object(result, (node, mine), group=group)
    failures = [f"node {n} (rank {r}): {err}" for r, (n, (_, err)) in enumerate(result) if err]
    if failures:
        _stop(started)
        raise OmniReduceError("colocated aggregators could not start: " + "; ".join(failures)
                              + " (or give aggregator addresses: OMNIREDUCE_AGGREGATORS)")
    addresses = [a for _, (addrs, _) in result for a in addrs]
    out = Colocated(addresses, token, node, started, log_threads)
    if started:
        at_exit(STOP, _close_at_exit, out)
        log.info("node %s: started %d aggregator(s) at %s", node, len(started), ", ".join(mine[0]))
    return out


def exiting_on_error() -> bool:
    """(At interpreter exit.) Whether the main script ended with an uncaught exception: then the
    other ranks are not ending too, and nothing is gained by waiting for them."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    """Stop aggregators that started, and close their pipes (a binding that failed)."""
    stop_processes(procs, grace=5.0)
    for p in procs:
        _close_pipes(p)


def _close_pipes(p: subprocess.Popen[str]) -> None:
    """Close this process's ends of an aggregator's pipes (it has ended): none is left for the
    garbage collector to find open (a ResourceWarning each)."""
    for pipe in (p.stdin, p.stdout, p.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError, ValueError):
                pipe.close()


def _close_at_exit(colocated: Colocated) -> None:
    colocated.close(drain=not exiting_on_error())


def _start_one(host: str, token: str, label: str,
               timeout: float) -> tuple[subprocess.Popen[str], str, threading.Thread]:
    listen = f"tcp://[{host}]:0" if ipaddress.ip_address(host).version == 6 else f"tcp://{host}:0"
    env = dict(os.environ, OMNIREDUCE_TOKEN=token)
    env.pop("OMNIREDUCE_TOKEN_FILE", None)
    # the workers' socket buffer setting, for the aggregator's side of their connections
    cmd = aggregator_command(listen, module=COLOCATED_MODULE, drain=DRAIN, log_level="WARNING", log_interval=0,
                             socket_buffer=env_socket_buffer())
    proc, address = start_aggregator(cmd, name=f"the aggregator of node {label}", timeout=timeout, env=env,
                                     stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    thread = threading.Thread(target=_forward, args=(proc.stderr, label), daemon=True,
                              name=f"omnireduce-agg-log-{label}")
    thread.start()
    return proc, address, thread


def _forward(stream: IO[str] | None, label: str) -> None:
    """Pass the aggregator's log lines on to this process's log, prefixed with its node."""
    if stream is None:
        return
    with contextlib.suppress(OSError, ValueError):  # (closed by Colocated.close once the aggregator ended)
        for line in stream:
            words = line.split(maxsplit=4)
            level = next((_LEVELS[w] for w in words[:4] if w in _LEVELS), logging.WARNING)
            log.log(level, "[omnireduce-agg %s] %s", label, line.rstrip())
