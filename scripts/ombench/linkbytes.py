"""The bytes that crossed a node's link, from the kernel's interface counters (not the library's).

A rank on the emulated network (:class:`ombench.network.Network` with ``ranks_per_node``) finds its
node's link in ``$OMBENCH_LINK``: the host's veth end inside its namespace. ``/proc/net/dev`` is
per network namespace (it lists the reading process's namespace's interfaces), so a rank reads its
own node's counters without leaving its namespace; ``tx`` is what left the node (up the link),
``rx`` what came in (down). The counters count whole frames as the veth passes them: payload plus
TCP/IP/Ethernet headers, and every byte on the link, the benchmark's own barriers included (a few
hundred bytes per step). Traffic between the node's ranks goes over the namespace's loopback and is
not counted here.

On loopback there is no node link (``lo`` carries every process's traffic, other users' too):
:func:`link_name` is None there and the benchmarks report the library's counters only.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

ENV = "OMBENCH_LINK"


@dataclasses.dataclass(frozen=True)
class Counters:
    """An interface's byte counters at one moment."""

    rx: int
    tx: int

    def __sub__(self, other: Counters) -> Counters:
        return Counters(self.rx - other.rx, self.tx - other.tx)


def link_name() -> str | None:
    """This rank's node link (``$OMBENCH_LINK``), or None where there is none (loopback)."""
    return os.environ.get(ENV) or None


def read(interface: str, proc_net_dev: Path = Path("/proc/net/dev")) -> Counters:
    """The receive and transmit byte counters of ``interface`` in this process's network namespace."""
    for line in proc_net_dev.read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == interface:
            values = fields.split()
            return Counters(rx=int(values[0]), tx=int(values[8]))
    raise KeyError(f"no interface {interface!r} in {proc_net_dev}")


def per_node(readings: list[tuple[int, Counters | None]]) -> list[Counters] | None:
    """One delta per node from every rank's ``(node, delta)`` (the ranks of a node read the same
    counters: the first rank's reading stands for its node); None when no rank had a link."""
    nodes: dict[int, Counters] = {}
    for node, delta in readings:
        if delta is not None:
            nodes.setdefault(node, delta)
    return [nodes[n] for n in sorted(nodes)] or None


def summary(deltas: list[Counters] | None, steps: int) -> dict[str, float | list[float]] | None:
    """Per step: each node's bytes up (tx) and down (rx), their means over nodes, and the busiest
    node link direction (what a full-duplex link's time is bound by)."""
    if not deltas or steps < 1:
        return None
    up = [d.tx / steps for d in deltas]
    down = [d.rx / steps for d in deltas]
    return {"up_per_node": up, "down_per_node": down, "up_mean": sum(up) / len(up),
            "down_mean": sum(down) / len(down), "busiest": max(up + down)}
