"""Network emulation harness: N worker and A aggregator "hosts" on one shaped, isolated Linux network.

Design
------
Every host is a Linux network namespace. One more namespace holds a Linux bridge (``br0``); each
host is joined to it by a veth pair that is *created inside the bridge namespace* with its peer
placed straight into the host namespace (``ip -n BR link add w0 type veth peer name ornet0 netns
HOST``), so no interface, address or route ever appears in the root namespace::

    ornet-<pid>-<k>-w0  [ornet0 10.X.0.1/16] --veth-- [w0]  \
    ornet-<pid>-<k>-w1  [ornet0 10.X.0.2/16] --veth-- [w1]   br0   (namespace ornet-<pid>-<k>-br)
    ornet-<pid>-<k>-a0  [ornet0 10.X.1.1/16] --veth-- [a0]  /

* Names: every namespace starts with ``ornet-<pid>-<k>-`` (``k`` counts clusters made by this
  process), so ``python scripts/netem.py cleanup`` can find leftovers and tell whether their owner
  is still alive. Inside each host the interface is called ``ornet0`` (:attr:`Host.interface`; pass
  it as ``GLOO_SOCKET_IFNAME``).
* Addresses: ``10.X.0.i`` for worker ``i-1`` and ``10.X.1.i`` for aggregator ``i-1``, on a /16.
  ``X`` is derived from the pid and a random draw. The subnet exists only inside this cluster's
  namespaces, so concurrent clusters cannot see each other even if ``X`` were to collide.
* Shaping: each link is shaped both ways with a ``tbf`` root qdisc: on the host-side veth
  (egress host -> bridge) and on the bridge-side veth (egress bridge -> host). A packet from
  worker 0 to aggregator 0 therefore crosses worker 0's uplink shaper and aggregator 0's downlink
  shaper, as on a switch whose ports all run at ``rate``.
* tbf parameters (see :func:`tbf_params`): ``burst = max(rate * 1 ms, 64 KiB)`` and
  ``limit = burst + rate * 4 ms``. tbf needs the bucket to hold at least one whole packet, and the
  veths use TSO/GSO, so TCP hands the qdisc packets of up to 64 KiB: a smaller burst makes tbf
  split them in software (slow) and a burst below a packet drops it. About 1 ms of tokens lets a
  single TCP stream keep the link busy across scheduler/timer jitter without letting through a
  noticeable over-rate spike. The queue (``limit``) holds ~4 ms beyond the bucket: enough that a
  single stream is not cut back by tail drops, small enough not to add bufferbloat latency. At
  1 Gbit/s that is burst 125 000 B, limit 625 000 B; at 10 Gbit/s burst 1.25 MB, limit 6.25 MB.
  Measured with :func:`measure_throughput` (one Python TCP stream, 2-core VM): 0.93-0.96 Gbit/s
  at 1gbit and ~9.5 Gbit/s at 10gbit (unshaped veths: ~17 Gbit/s). A burst of 0.1 ms (12.5 kB,
  below one GSO packet) gave only 0.88 Gbit/s at 1gbit; the queue length (1-10 ms) made no
  difference to a single stream, but bounds queueing delay when several senders converge on one
  host's downlink (incast to an aggregator).
* What the rate means: tbf counts every byte of the Ethernet frame (14 B header + IP + TCP), so
  TCP goodput tops out at 1448/1514 = 95.6% of ``rate`` with 1500-byte MTU and TCP timestamps. A
  real Ethernet link also spends 24 B per frame on preamble and inter-frame gap (94.1%), so the
  emulated link is ~1.5% more generous than a physical one of the same nominal speed.
* Teardown (:meth:`Cluster.close`, idempotent) always runs: on leaving the ``with`` block, on
  exceptions, on Ctrl-C (``KeyboardInterrupt``), on SIGTERM/SIGHUP (while a cluster is open and the
  signal has its default disposition, it is turned into ``SystemExit(128 + signum)`` so the
  ``with`` block unwinds), and from ``atexit`` for clusters never closed. Teardown blocks
  SIGINT/SIGTERM/SIGHUP while it runs, kills every process still inside the namespaces (SIGTERM,
  then SIGKILL after a grace period), then deletes host and bridge namespaces; deleting the bridge
  namespace destroys every veth pair. SIGKILL cannot be caught: use ``netem.py cleanup``.

Usage::

    from ombench import netem

    ok, why = netem.available()
    with netem.Cluster(workers=4, aggregators=1, rate="1gbit") as c:
        agg = c.aggregators[0]
        p = agg.popen([sys.executable, "-m", "omnireduce.aggregator.cli", "--listen", f"tcp://{agg.address}:5555"])
        env = {**os.environ, "GLOO_SOCKET_IFNAME": c.workers[0].interface}
        c.run(c.workers[0], [sys.executable, "train.py"], env=env, check=True)
        bps = netem.measure_throughput(c.workers[0], c.workers[1], seconds=3)

The command line (``python scripts/netem.py selftest|cleanup|run``) is scripts/netem.py.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), iproute2 (``ip``, ``tc``) and kernel support for
network namespaces, veth, bridge and tbf; :func:`available` says why not.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "ornet-"
"""Every namespace this module creates is named ``PREFIX + "<pid>-<k>-<role>"``."""

IFNAME = "ornet0"
"""Name of the host's interface inside every host namespace."""

BRIDGE = "br0"
BURST_S = 0.001  # tbf bucket: 1 ms of tokens at the link rate ...
MIN_BURST = 64 * 1024  # ... but at least one 64 KiB GSO packet
QUEUE_S = 0.004  # tbf queue beyond the bucket: 4 ms at the link rate

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_counter = itertools.count()
_live: set[Cluster] = set()
_lock = threading.RLock()
_saved_handlers: dict[int, Any] = {}
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_BLOCK_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


class NetemError(RuntimeError):
    """Setting up or using the emulated network failed."""


# --------------------------------------------------------------------------------------------
# helpers


def parse_rate(rate: str | int | None) -> int | None:
    """``"1gbit"`` -> 1_000_000_000 bits/s (SI units, as tc); ``None``/``"none"``/0 -> ``None`` (unshaped)."""
    if rate is None:
        return None
    if isinstance(rate, int):
        return rate or None
    s = rate.strip().lower()
    if s in ("", "none", "0", "off"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:bit|bps|b)?(?:/s)?", s)
    if not m:
        raise ValueError(f"cannot parse rate {rate!r}: use e.g. '1gbit', '10gbit', '100mbit' or 'none'")
    bps = int(float(m.group(1)) * _UNITS[m.group(2)])
    return bps or None


def tbf_params(rate_bps: int) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf at ``rate_bps`` bits/s (see the module docstring)."""
    byte_rate = rate_bps / 8
    burst = max(int(byte_rate * BURST_S), MIN_BURST)
    limit = burst + int(byte_rate * QUEUE_S)
    return burst, limit


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    return _cmd(["ip", *args], check=check, timeout=timeout)


def _cmd(argv: list[str], check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    log.debug("+ %s", " ".join(argv))
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise NetemError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return r


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Names of the network namespaces (``ip netns list``) that start with ``prefix``."""
    r = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def list_links(prefix: str = PREFIX) -> list[str]:
    """Names of root-namespace links (``ip link``) that start with ``prefix`` (there should be none)."""
    r = _ip("-o", "link", "show", check=False)
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@")[0]
            if name.startswith(prefix):
                out.append(name)
    return out


def _netns_pids(ns: str) -> list[int]:
    """Pids of the processes inside namespace ``ns`` (not this one); [] if ``ip`` cannot say."""
    try:
        r = _ip("netns", "pids", ns, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.error("could not list the processes in namespace %s: %s", ns, e)
        return []
    return [int(p) for p in r.stdout.split() if p.isdigit() and int(p) != os.getpid()]


def _delete_namespaces(names: Sequence[str]) -> list[str]:
    """``ip netns del`` each of ``names`` in order; a failure is logged and the rest still go. Returns
    the names deleted."""
    deleted = []
    for ns in names:
        try:
            r = _ip("netns", "del", ns, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            log.error("could not delete namespace %s: %s", ns, e)
            continue
        if r.returncode == 0:
            deleted.append(ns)
        else:
            log.error("could not delete namespace %s: %s", ns, r.stderr.strip())
    return deleted


def _kill_pids(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _kill_namespace_processes(namespaces: Sequence[str], popens: Sequence[subprocess.Popen[Any]],
                              grace: float = 2.0) -> None:
    """SIGTERM everything inside ``namespaces`` (and ``popens``), SIGKILL what is left after ``grace`` s."""

    def alive() -> list[int]:
        pids = {pid for ns in namespaces for pid in _netns_pids(ns)}
        pids |= {p.pid for p in popens if p.poll() is None}
        return sorted(pids)

    pids = alive()
    if not pids:
        return
    log.info("terminating %d process(es) still inside the namespaces: %s", len(pids), pids)
    _kill_pids(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.05)
        pids = alive()
        if not pids:
            return
    log.warning("killing %d process(es) that ignored SIGTERM: %s", len(pids), pids)
    _kill_pids(pids, signal.SIGKILL)
    for p in popens:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=2.0)


@functools.lru_cache(maxsize=1)
def available() -> tuple[bool, str]:
    """Whether this machine can run a :class:`Cluster`, and if not, why (a sentence to show the user).

    Checks root, ``ip``/``tc``, then really creates a probe namespace with a bridge, a veth pair and
    a tbf qdisc, and removes it. The answer is cached for the process.
    """
    if sys.platform != "linux":
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN/CAP_SYS_ADMIN) to create network namespaces; run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found (install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe{random.randrange(10**6)}"
    try:
        try:
            _ip("netns", "add", probe)
        except (NetemError, OSError, subprocess.TimeoutExpired) as e:
            return False, f"`ip netns` is unavailable: {e}"
        steps = [
            (["ip", "-n", probe, "link", "add", "b0", "type", "bridge"], "Linux bridge"),
            (["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"], "veth"),
            (["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", "tbf", "rate", "1gbit",
              "burst", "125000", "limit", "625000"], "tc tbf"),
        ]
        for argv, what in steps:
            try:
                _cmd(argv)
            except (NetemError, OSError, subprocess.TimeoutExpired) as e:
                return False, f"{what} is unavailable: {e}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, "ok"


# --------------------------------------------------------------------------------------------
# signals: SIGTERM/SIGHUP -> SystemExit while a cluster is open, so `with` blocks unwind


def _raise_exit(signum: int, frame: Any) -> None:
    log.warning("received %s: tearing down the emulated network", signal.Signals(signum).name)
    raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _EXIT_SIGNALS:
        if sig in _saved_handlers:
            continue
        prev = signal.getsignal(sig)
        if prev is signal.SIG_DFL:  # respect handlers (and SIG_IGN) the application installed
            signal.signal(sig, _raise_exit)
            _saved_handlers[sig] = prev


def _restore_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, prev in list(_saved_handlers.items()):
        if signal.getsignal(sig) is _raise_exit:
            signal.signal(sig, prev)
        del _saved_handlers[sig]


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    """Defer SIGINT/SIGTERM/SIGHUP (delivered afterwards) so teardown cannot be interrupted halfway."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCK_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@atexit.register
def _close_all() -> None:
    with _lock:
        live = list(_live)
    for c in live:
        c.close()


# --------------------------------------------------------------------------------------------
# the cluster


@dataclasses.dataclass(eq=False)
class Host:
    """One emulated machine: a network namespace with one shaped interface on the cluster's bridge."""

    name: str
    """Network namespace name (``ip netns exec <name> ...``)."""
    role: str
    """``"worker"`` or ``"aggregator"``."""
    index: int
    address: str
    """IPv4 address of :attr:`interface` (no prefix length)."""
    interface: str
    """Interface name inside the namespace; use as ``GLOO_SOCKET_IFNAME``."""
    bridge_port: str
    """Name of the veth's other end, inside the bridge namespace."""
    cluster: Cluster = dataclasses.field(repr=False)

    @property
    def label(self) -> str:
        """Short name: ``w0``, ``a1``..."""
        return f"{self.role[0]}{self.index}"

    def argv(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` prefixed so that it runs inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def popen(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(cmd, **kwargs)`` inside this namespace; killed at teardown if still running."""
        return self.cluster.popen(self, cmd, **kwargs)

    def run(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run(cmd, **kwargs)`` inside this namespace."""
        return self.cluster.run(self, cmd, **kwargs)


class Cluster:
    """``workers`` + ``aggregators`` hosts on one bridge, each link shaped to ``rate`` both ways.

    Use as a context manager (or call :meth:`start` and :meth:`close`). ``rate`` is a tc rate
    (``"1gbit"``, ``"10gbit"``, ``"100mbit"``), bits/s as an int, or ``None``/``"none"`` for
    unshaped links. ``burst``/``limit`` (bytes) override :func:`tbf_params`.
    """

    def __init__(self, workers: int = 2, aggregators: int = 1, rate: str | int | None = "1gbit", *,
                 burst: int | None = None, limit: int | None = None, prefix: str = PREFIX) -> None:
        if not (0 <= workers <= 254 and 0 <= aggregators <= 254 and workers + aggregators >= 1):
            raise ValueError("need 0..254 workers and 0..254 aggregators, at least one host")
        self.rate_bps = parse_rate(rate)
        if self.rate_bps is not None:
            b, lim = tbf_params(self.rate_bps)
            self.burst, self.limit = burst or b, limit or lim
        else:
            self.burst = self.limit = None
        self.id = f"{prefix}{os.getpid()}-{next(_counter)}"
        octet = 16 + (os.getpid() * 31 + random.randrange(1 << 16)) % 224  # 10.16.x.x .. 10.239.x.x
        self.subnet = f"10.{octet}.0.0/16"
        self.bridge_ns = f"{self.id}-br"
        self.workers = [self._host("worker", i, f"10.{octet}.0.{i + 1}") for i in range(workers)]
        self.aggregators = [self._host("aggregator", i, f"10.{octet}.1.{i + 1}") for i in range(aggregators)]
        self._created: list[str] = []  # namespaces that exist, in creation order
        self._popens: list[subprocess.Popen[Any]] = []
        self._started = self._closed = False

    def _host(self, role: str, i: int, address: str) -> Host:
        label = f"{role[0]}{i}"
        return Host(name=f"{self.id}-{label}", role=role, index=i, address=address, interface=IFNAME,
                    bridge_port=label, cluster=self)

    @property
    def hosts(self) -> list[Host]:
        """Workers, then aggregators."""
        return self.workers + self.aggregators

    def host(self, label: str) -> Host:
        """A host by its short name (``"w0"``, ``"a1"``)."""
        for h in self.hosts:
            if h.label == label:
                return h
        raise KeyError(f"no host {label!r}; have {[h.label for h in self.hosts]}")

    # -- lifecycle

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Cluster:
        """Create the namespaces, bridge, veths and qdiscs. On any failure, removes what it made and raises."""
        if self._started:
            raise NetemError("cluster already started")
        ok, why = available()
        if not ok:
            raise NetemError(f"cannot emulate a network here: {why}")
        self._started = True
        with _lock:
            _live.add(self)
            _install_signal_handlers()
        t0 = time.monotonic()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        shaping = "unshaped"
        if self.rate_bps:
            shaping = f"tbf rate {self.rate_bps}bit burst {self.burst}B limit {self.limit}B"
        log.info("netem cluster %s up in %.2fs: %d workers, %d aggregators on %s, %s", self.id,
                 time.monotonic() - t0, len(self.workers), len(self.aggregators), self.subnet, shaping)
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_bps is None:
            return
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{self.rate_bps}bit",
              "burst", str(self.burst), "limit", str(self.limit)])

    def _setup(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", br, "link", "set", BRIDGE, "up")
        for h in self.hosts:
            self._add_ns(h.name)
            _ip("-n", br, "link", "add", h.bridge_port, "type", "veth", "peer", "name", h.interface, "netns", h.name)
            _ip("-n", br, "link", "set", h.bridge_port, "master", BRIDGE)
            _ip("-n", br, "link", "set", h.bridge_port, "up")
            _ip("-n", h.name, "addr", "add", f"{h.address}/16", "dev", h.interface)
            _ip("-n", h.name, "link", "set", h.interface, "up")
            self._shape(h.name, h.interface)  # host -> bridge
            self._shape(br, h.bridge_port)  # bridge -> host

    def close(self) -> None:
        """Kill processes left in the namespaces and delete them (veths and bridge go with them). Idempotent.

        Every step runs even if an earlier one fails (the failure is logged): a namespace that cannot
        be deleted is left for ``netem.py cleanup``.
        """
        if self._closed or not self._started:
            return
        with _signals_blocked():  # before anything else: a signal now would skip the teardown
            self._closed = True
            try:
                try:
                    _kill_namespace_processes(self._created, self._popens)
                except Exception as e:  # log it and still delete the namespaces
                    log.error("cluster %s: stopping its processes failed: %s", self.id, e)
                # newest first: the hosts, then the bridge namespace (created first), which takes the veths
                doomed = list(reversed(self._created))
                deleted = _delete_namespaces(doomed)
                left = [ns for ns in doomed if ns not in deleted]
                if left:
                    log.error("cluster %s: left behind %s; remove them with `python scripts/netem.py cleanup`",
                              self.id, " ".join(left))
                self._created.clear()
            finally:
                with _lock:
                    _live.discard(self)
                    if not _live:
                        _restore_signal_handlers()
        log.info("netem cluster %s torn down", self.id)

    # -- running things

    def _check_host(self, host: Host) -> None:
        if host.cluster is not self:
            raise ValueError(f"{host.name} is not a host of cluster {self.id}")
        if not self._started or self._closed:
            raise NetemError(f"cluster {self.id} is not running")

    def popen(self, host: Host, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen`` of ``cmd`` inside ``host``'s namespace (``ip netns exec``; ``pid`` is the command's)."""
        self._check_host(host)
        p = subprocess.Popen(host.argv(cmd), **kwargs)
        self._popens.append(p)
        return p

    def run(self, host: Host, cmd: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """``subprocess.run`` of ``cmd`` inside ``host``'s namespace."""
        self._check_host(host)
        return subprocess.run(host.argv(cmd), **kwargs)

    def cut(self, a: Host, b: Host) -> None:
        """Partition ``a`` from ``b``: every packet between them is dropped silently, both ways (a
        blackhole route in each namespace), as when a switch port or a cable fails; their TCP
        connections stay open and retransmit. Traffic with every other host flows on."""
        for src, dst in ((a, b), (b, a)):
            _cmd(src.argv(["ip", "route", "replace", "blackhole", f"{dst.address}/32"]))

    def heal(self, a: Host, b: Host) -> None:
        """Undo :meth:`cut`."""
        for src, dst in ((a, b), (b, a)):
            _cmd(src.argv(["ip", "route", "del", "blackhole", f"{dst.address}/32"]), check=False)

    def env(self) -> dict[str, str]:
        """Environment variables describing the cluster (for the CLI's ``run``)."""
        return {
            "NETEM_ID": self.id,
            "NETEM_IFNAME": IFNAME,
            "NETEM_WORKER_ADDRS": ",".join(h.address for h in self.workers),
            "NETEM_AGGREGATOR_ADDRS": ",".join(h.address for h in self.aggregators),
            "NETEM_WORKER_NS": ",".join(h.name for h in self.workers),
            "NETEM_AGGREGATOR_NS": ",".join(h.name for h in self.aggregators),
        }


# --------------------------------------------------------------------------------------------
# throughput: one TCP stream, plain Python, measured at the receiver

_RECEIVER = r"""
import json, socket, sys, time
addr, port, warmup, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, port))
srv.listen(1)
srv.settimeout(timeout)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(timeout)
buf = bytearray(1 << 22)
view = memoryview(buf)
total = 0
first = mark = None
mark_bytes = 0
while True:
    n = conn.recv_into(view)
    now = time.perf_counter()
    if not n:
        break
    total += n
    if first is None:
        first = now
    elif mark is None and now - first >= warmup:
        mark, mark_bytes = now, total
    last = now
if mark is None or last <= mark:
    mark, mark_bytes = first, 0
secs = last - mark
print(json.dumps({"bytes": total - mark_bytes, "seconds": secs, "total_bytes": total,
                  "bps": (total - mark_bytes) * 8 / secs if secs > 0 else 0.0}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((addr, port), timeout=10)
chunk = b"\0" * (1 << 20)
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    s.sendall(chunk)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


def measure_throughput(src: Host, dst: Host, seconds: float = 3.0, port: int = 5201,
                       warmup: float | None = None) -> float:
    """Bits/s of one TCP stream from ``src`` to ``dst``, measured at the receiver.

    A receiver (``sys.executable -c``) listens in ``dst``'s namespace; a sender in ``src``'s
    namespace connects and writes 1 MiB chunks for ``seconds``. The rate counts bytes received after
    the first ``warmup`` seconds of data (default ``min(0.5, seconds / 4)``, excluding connection
    setup, slow start and the initial tbf burst) up to the last byte.
    """
    if warmup is None:
        warmup = min(0.5, seconds / 4)
    timeout = seconds + 20
    rx = dst.popen([sys.executable, "-c", _RECEIVER, dst.address, str(port), str(warmup), str(timeout)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tx = None
    try:
        assert rx.stdout is not None
        line = rx.stdout.readline().strip()
        if line != "ready":
            err = rx.stderr.read() if rx.stderr else ""
            raise NetemError(f"throughput receiver in {dst.name} failed to start: {line!r} {err.strip()}")
        tx = src.popen([sys.executable, "-c", _SENDER, dst.address, str(port), str(seconds)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        out, err = rx.communicate(timeout=timeout)
        _, tx_err = tx.communicate(timeout=10)
        if rx.returncode != 0 or tx.returncode != 0:
            raise NetemError(f"throughput test {src.label}->{dst.label} failed: receiver rc={rx.returncode} "
                             f"{err.strip()}; sender rc={tx.returncode} {tx_err.strip()}")
        res = json.loads(out.strip().splitlines()[-1])
        log.info("throughput %s->%s: %.3f Gbit/s (%d bytes in %.2fs after %.2fs warm-up)", src.label, dst.label,
                 res["bps"] / 1e9, res["bytes"], res["seconds"], warmup)
        return float(res["bps"])
    finally:
        for p in (tx, rx):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


# --------------------------------------------------------------------------------------------
# cleanup of leftovers (e.g. after SIGKILL)


def _owner_alive(ns: str, prefix: str) -> bool:
    m = re.match(re.escape(prefix) + r"(\d+)-", ns)
    if not m:
        return False
    pid = int(m.group(1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(prefix: str = PREFIX, include_live: bool = False) -> list[str]:
    """Delete namespaces named ``prefix*`` (killing processes inside) and root-namespace links named ``prefix*``.

    By default only namespaces whose owner pid (``<prefix><pid>-...``) is gone are removed, so
    clusters of concurrently running processes survive; ``include_live=True`` removes all. Returns
    the names removed.
    """
    names = list_namespaces(prefix)
    doomed = [n for n in names if include_live or not _owner_alive(n, prefix)]
    for n in sorted(set(names) - set(doomed)):
        log.info("keeping %s: its owner process is still running (use --all to remove it)", n)
    removed: list[str] = []
    with _signals_blocked():
        if doomed:
            try:
                _kill_namespace_processes(doomed, [])
            except Exception as e:  # log it and still delete the namespaces
                log.error("stopping the processes in %s failed: %s", " ".join(doomed), e)
        removed += _delete_namespaces(sorted(doomed, key=lambda n: n.endswith("-br")))  # bridges last
        for link in list_links(prefix):  # never created by this module, but clean anyway
            if _ip("link", "del", link, check=False).returncode == 0:
                removed.append(link)
    return removed
