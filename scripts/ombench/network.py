"""Where a benchmark's processes run: this machine's loopback, or an emulated network.

A :class:`Network` is one place to run W ranks and A aggregators, named like the benchmarks'
command lines name it:

* ``"loopback"``: plain processes on this machine; Gloo and the aggregators on 127.0.0.1 (the
  aggregators on free ports).
* a link rate (``"1gbit"``, ``"10gbit"``, ``"100mbit"``): a :class:`~ombench.netem.Cluster`
  of W worker and A aggregator hosts, each a network namespace on one bridge with its link shaped
  to the rate both ways. Rank r runs in worker host r; aggregator i runs in aggregator host i,
  listening on that host's address with ``--insecure`` (the namespaces are private); Gloo meets at
  worker 0's address on the hosts' interface.

Nodes of several ranks (``ranks_per_node=L``): ranks ``r`` with the same ``r // L`` share a node.
On the emulated network a node is one worker host (namespace) holding its L ranks: they reach each
other over the namespace's loopback (a packet to the host's own address never leaves it:
unlimited), and the other nodes over the host's shaped link. :meth:`Network.rank_env` gives each
rank ``GROUP_RANK=<node>`` (what :func:`omnireduce.colocate.node_name` and the hierarchy's topology
read), ``LOCAL_RANK``, ``MASTER_ADDR`` and ``GLOO_SOCKET_IFNAME``/``OMNIREDUCE_IFNAME`` (the host's
interface, so that Gloo's and the colocated aggregators' cross-node traffic takes the shaped link),
and on the emulated network ``OMBENCH_LINK=<interface>``: the interface whose counters are the
node's link (:mod:`ombench.linkbytes`). On loopback the same variables make the ranks see ``N``
nodes, all on 127.0.0.1. With L = 1 (the default) every rank is its own node, as before.

Either way the benchmark asks for the same things (start the aggregators, start rank r's process,
the rendezvous address and port, the interface for ``GLOO_SOCKET_IFNAME``), and closing the
network (leaving its ``with`` block, also on errors and Ctrl-C) stops every process it started,
then tears the emulated network down. :func:`exit_on_signals` turns SIGTERM and SIGHUP into
``SystemExit`` so that this also happens when the benchmark is killed.

If the benchmark dies without cleaning up (SIGKILL), its children go too, by the library's one
policy for children (:mod:`omnireduce.launch.procs`), not ``PR_SET_PDEATHSIG``: each is started with its
standard input a pipe from the benchmark, which the kernel closes when the benchmark dies. The
aggregators run as ``python -m omnireduce.aggregator.colocated`` (an ``omnireduce-agg`` that stops
when that pipe ends), and the ranks :meth:`Network.run_ranks` starts call
:func:`omnireduce.lifetime.exit_with_parent` (bench_train's and bench_memory's rank modes do).
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from omnireduce.launch.procs import COLOCATED_MODULE, aggregator_command, free_port, start_aggregator, stop_processes

log = logging.getLogger(__name__)

LOOPBACK = "loopback"
FIRST_MASTER_PORT = 29500  # a fresh emulated network has every port free: rendezvous ports count up from here


def exit_on_signals(prog: str) -> None:
    """Turn SIGTERM and SIGHUP into ``SystemExit(128 + signum)`` so that ``finally`` blocks and context
    managers stop the benchmark's processes and networks. Signals whose disposition is not the
    default (an application's handler, or SIG_IGN from nohup) are left alone."""

    def handler(signum: int, _frame: object) -> None:
        log.warning("%s: %s: stopping the workers, aggregators and network", prog, signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, handler)


def print_log_tails(logs: list[Path], lines: int = 15) -> None:
    """The last lines of each rank's log, on standard error (after a failed setting)."""
    for log_path in logs:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        if tail:
            print(f"  --- {log_path.name} (last lines)\n    " + "\n    ".join(tail), file=sys.stderr)


class Network:
    """Loopback or an emulated network (see the module docstring) for ``workers`` ranks and
    ``aggregators`` aggregators.

    Use as a context manager; every process started through it is stopped on the way out (SIGTERM,
    then SIGKILL after ``grace`` seconds), before the emulated network is torn down; those started
    with a pipe as standard input (the aggregators, the ranks of :meth:`run_ranks`) also stop by
    themselves when this process dies.
    """

    def __init__(self, name: str, workers: int, aggregators: int, *, grace: float = 10.0,
                 ranks_per_node: int = 1) -> None:
        if ranks_per_node < 1 or workers % ranks_per_node:
            raise ValueError(f"{workers} ranks do not make nodes of {ranks_per_node}")
        self.name = name
        self.grace = grace
        self.ranks_per_node = ranks_per_node
        self.nodes = workers // ranks_per_node
        """How many nodes (worker hosts) the ranks take."""
        self.cluster: Any = None
        """The :class:`~ombench.netem.Cluster`, or None on loopback."""
        self.procs: list[subprocess.Popen[Any]] = []
        self.aggregators: list[str] = []
        """Addresses of the aggregators started so far."""
        self.aggregator_pids: list[int] = []
        self._count = aggregators
        self._ports = iter(range(FIRST_MASTER_PORT, FIRST_MASTER_PORT + 1000))
        if name == LOOPBACK:
            self.master_addr, self.interface = "127.0.0.1", "lo"
            self._worker_popen: list[Callable[..., subprocess.Popen[Any]]] = [subprocess.Popen] * workers
            self._aggregator_popen: list[Callable[..., subprocess.Popen[Any]]] = [subprocess.Popen] * aggregators
            self._aggregator_host = ["127.0.0.1"] * aggregators
        else:
            from ombench.netem import Cluster

            self.cluster = Cluster(workers=self.nodes, aggregators=aggregators, rate=name).start()
            c = self.cluster
            self.master_addr, self.interface = c.workers[0].address, c.workers[0].interface
            self._worker_popen = [c.workers[r // ranks_per_node].popen for r in range(workers)]
            self._aggregator_popen = [h.popen for h in c.aggregators]
            self._aggregator_host = [h.address for h in c.aggregators]

    def __enter__(self) -> Network:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def info(self) -> dict[str, Any]:
        """The network's name and, when emulated, its rate, tbf sizes and subnet (for the JSON)."""
        info: dict[str, Any] = {"name": self.name}
        if self.ranks_per_node > 1:
            info.update(nodes=self.nodes, ranks_per_node=self.ranks_per_node)
        if self.cluster is not None:
            c = self.cluster
            info.update(rate_bps=c.rate_bps, tbf_burst_bytes=c.burst, tbf_limit_bytes=c.limit, subnet=c.subnet)
        return info

    def node_of(self, rank: int) -> int:
        """The node (worker host) of rank ``rank``."""
        return rank // self.ranks_per_node

    def rank_env(self, rank: int) -> dict[str, str]:
        """What rank ``rank``'s environment needs to know where it is (see the module docstring):
        empty with one rank per node, as before."""
        if self.ranks_per_node == 1:
            return {}
        env = {"GROUP_RANK": str(self.node_of(rank)), "LOCAL_RANK": str(rank % self.ranks_per_node),
               "MASTER_ADDR": self.master_addr, "GLOO_SOCKET_IFNAME": self.interface}
        if self.cluster is not None:
            env.update(OMNIREDUCE_IFNAME=self.interface, OMBENCH_LINK=self.interface)
        return env

    def master_port(self) -> int:
        """A port for Gloo's rendezvous: a free one on loopback, the next unused one in a fresh emulated network."""
        return free_port() if self.cluster is None else next(self._ports)

    def start_aggregators(self, *, port: int = 0, socket_buffer: int = 0, logdir: Path | None = None,
                          **popen_kwargs: Any) -> list[str]:
        """Start one aggregator per aggregator host (on ``port``; 0: any free one) and return their addresses.

        Each process is kept as soon as it runs, so that :meth:`close` stops those started before
        a failure too; each logs warnings and errors only and stops by itself if this process dies
        (``omnireduce.aggregator.colocated``, its standard input a pipe from here). ``logdir``: each
        aggregator's standard error goes to ``<name>-agg<i>.log`` there, and the log is in the
        ``RuntimeError`` raised when one does not start; without it their standard error is this
        process's. ``popen_kwargs`` go to ``subprocess.Popen``.
        """
        popen_kwargs.setdefault("stdin", subprocess.PIPE)
        for i in range(self._count):
            cmd = aggregator_command(f"tcp://{self._aggregator_host[i]}:{port}", module=COLOCATED_MODULE,
                                     insecure=self.cluster is not None, log_level="WARNING",
                                     socket_buffer=socket_buffer)
            popen, name = self._aggregator_popen[i], f"aggregator {i}"
            if logdir is None:
                p, address = start_aggregator(cmd, popen, name=name, **popen_kwargs)
            else:
                log_path = logdir / f"{self.name}-agg{i}.log"
                try:
                    with open(log_path, "w") as f:
                        p, address = start_aggregator(cmd, popen, name=name, stderr=f, **popen_kwargs)
                except RuntimeError as e:
                    raise RuntimeError(f"{e}: {log_path.read_text(errors='replace').strip()}") from None
            self.procs.append(p)
            self.aggregators.append(address)
            self.aggregator_pids.append(p.pid)
        return list(self.aggregators)

    def popen(self, rank: int, cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """``subprocess.Popen(cmd, **kwargs)`` where rank ``rank`` runs (its worker host's namespace)."""
        p = self._worker_popen[rank](cmd, **kwargs)
        self.procs.append(p)
        return p

    def run_ranks(self, cmd: list[str], envs: list[dict[str, str]], logs: list[Path], timeout: float, *,
                  rank0_stdout: bool = False) -> str | None:
        """Run ``cmd`` as every rank (rank r with ``envs[r]``, its output to ``logs[r]``; rank 0's
        standard output to this process's with ``rank0_stdout``); wait until all exit, one fails or
        ``timeout`` seconds pass, then stop those left. Returns None if every rank exited with 0, else
        what went wrong. Each rank's standard input is a pipe from this process: ``cmd`` calls
        :func:`omnireduce.lifetime.exit_with_parent` to die with the benchmark even if it is SIGKILLed."""
        procs: list[subprocess.Popen[Any]] = []
        t0 = time.monotonic()
        error = None
        try:
            for rank, (env, log_path) in enumerate(zip(envs, logs, strict=True)):
                with open(log_path, "w") as out:
                    stdout = None if rank == 0 and rank0_stdout else out
                    procs.append(self.popen(rank, cmd, env=env, stdin=subprocess.PIPE, stdout=stdout,
                                            stderr=out))
            while error is None:
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    break
                bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    error = f"rank {bad[0][0]} exited with code {bad[0][1]}"
                elif time.monotonic() - t0 > timeout:
                    error = f"timed out after {timeout:g} s"
                else:
                    time.sleep(0.1)
        finally:
            stop_processes(procs, grace=5.0)
            _close_stdin(procs)
        return error

    def close(self) -> None:
        """Stop every process started here, then tear down the emulated network. Idempotent."""
        try:
            stop_processes(self.procs, grace=self.grace)
            _close_stdin(self.procs)
        finally:
            if self.cluster is not None:
                self.cluster.close()


def _close_stdin(procs: list[subprocess.Popen[Any]]) -> None:
    """Close this side of each (stopped) process's standard input pipe."""
    for p in procs:
        if p.stdin is not None:
            p.stdin.close()
