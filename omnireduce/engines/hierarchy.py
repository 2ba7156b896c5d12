"""Nodes of several ranks: sum inside the node, reduce across nodes one rail per local rank, share inside.

A flat all-reduce over ``W`` ranks on ``N`` nodes of ``L = W / N`` ranks each sends every rank's
blocks over its node's links; where the ranks of a node share a fast interconnect (NVLink, or one
host's memory) most of that traffic has no business on the network. Three steps instead, for a
flat buffer of ``n`` elements cut into ``L`` shards of ``s = ceil(n / L)`` (the last one padded):

1. **Inside the node**: reduce-scatter over the node's ranks (a process group of the node), so that
   local rank ``i`` holds shard ``i`` of the node's sum.
2. **Across nodes**: local rank ``i`` of every node forms *rail* ``i``; it reduces its shard among
   the rail's members (one per node) with whatever the caller gives (``cross``: omnireduce, or the
   dense all-reduce of the rail's process group). The shard's block density is that of the node's
   sum, and a node sends each block of it once instead of once per rank.
3. **Inside the node**: all-gather the shards, so that every rank holds the whole sum (divided by
   ``W`` when averaging, as DDP does).

Ordering. Collectives of a process group must be issued in the same order on all of its members,
and an omnireduce tensor's sequence number is its place in the order its worker was given tensors:
the same on every member of a rail. Step 1 is issued by the caller (the training thread, in DDP's
bucket order); steps 2 and 3 depend on the previous step's completion, which different ranks see in
different orders. So they run on two threads of :class:`Hierarchy` that each take the buffers in the
order they were submitted: one waits for a buffer's step 1 and starts its step 2, the other waits
for its step 2 and runs its step 3. Each thread has process groups of its own (steps 1 and 3 use
two groups of the same node's ranks): two threads issuing into one group would interleave their
collectives differently on different ranks, and pair one rank's all-gather with another's
reduce-scatter. A step that fails still issues the later collectives of that
buffer (on garbage), so the node's ranks never fall out of step; the buffer's future then fails
with the first error, and every later buffer fails at once, with no collective (the job cannot go
on; the other ranks meet their own deadlines). Every wait has the deadline given to
:class:`Hierarchy`.

Sparse rows. A sparse COO tensor (an embedding's gradient, ``R x D``) takes the same three steps by
rows (:meth:`Hierarchy.reduce_rows`), moving only the rows present: in step 2 the node's ranks gather
each other's rows (counts first, then ids and values, through a group of the node's ranks that only
that thread uses) and each keeps the rows of its rail (``row mod L``), duplicates summed in float32;
the rail reduces them across the nodes (``cross``: omnireduce's sparse path); in step 3 the node's
ranks gather the rails' results, disjoint sets of rows, into the whole sum.

Topology. A node is what the colocated aggregators call one (the host, or torchrun's node rank):
:func:`discover` gathers every rank's node name once. Nodes are numbered by their lowest rank, and
a node's local ranks in ascending rank order. The groups (one per node, one per rail) are created
over the whole default group, in the same order on every rank: :func:`wanted` turns the hierarchy
off, with the reason, where it cannot or need not run (a process group other than the default one,
nodes of unequal size, no node with more than one rank).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.placement import node_name

log = logging.getLogger("omnireduce.hierarchy")

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older releases have only those.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: What step 2 is given: the shard to reduce in place across the rail. It returns something to wait
#: for (a ``concurrent.futures.Future``, a ``torch.futures.Future``, a ``dist.Work``), or None when
#: the shard is already reduced (a single node).
Cross = Callable[[torch.Tensor], Any]


@dataclasses.dataclass(frozen=True)
class Topology:
    """Which ranks of a process group share a node. ``nodes``: each node's ranks (ascending), nodes
    ordered by their lowest rank; ``rank``: this process's rank in the group."""

    nodes: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def node(self) -> int:
        """This rank's node (its index in ``nodes``)."""
        return next(i for i, ranks in enumerate(self.nodes) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def even(self) -> bool:
        """Every node holds as many ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def shared(self) -> bool:
        """Some node holds more than one rank."""
        return any(len(n) > 1 for n in self.nodes)

    def rail(self, i: int) -> tuple[int, ...]:
        """Local rank ``i`` of every node, in node order (even nodes only)."""
        return tuple(n[i] for n in self.nodes)

    def describe(self) -> str:
        sizes = [len(n) for n in self.nodes]
        if self.even:
            return f"{len(sizes)} node(s) x {sizes[0]} rank(s)"
        return f"{len(sizes)} nodes of {' + '.join(map(str, sizes))} ranks"

    @classmethod
    def from_names(cls, names: list[str], rank: int) -> Topology:
        """The topology of ranks whose node names are ``names`` (one per rank, in rank order)."""
        order: dict[str, list[int]] = {}
        for r, name in enumerate(names):
            order.setdefault(name, []).append(r)
        return cls(tuple(tuple(ranks) for ranks in order.values()), rank)


def discover(group: Any = None, node: str | None = None) -> Topology:
    """Every rank's node, gathered over ``group`` (collective). ``node``: this rank's node name
    (default: :func:`omnireduce.placement.node_name`, the host or torchrun's node rank)."""
    if node is None:
        node = node_name()
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, node, group=group)
    return Topology.from_names([str(n) for n in names], dist.get_rank(group))


def wanted(setting: bool | None, topology: Topology, group: Any = None) -> tuple[bool, str]:
    """Whether to run the hierarchy (``setting``: None for "where there are several nodes and some
    holds several ranks", True or False to force it), and why, in words for the log. On one node,
    True reduces inside the node alone (reduce-scatter and all-gather: no step 2)."""
    if setting is False:
        return False, "hierarchical=False"
    if not topology.shared:
        return False, f"every node holds one rank ({topology.describe()})"
    if len(topology.nodes) == 1 and setting is None:
        return False, (f"one node ({topology.describe()}): every rank is a worker of its own (hierarchical=True "
                       "sums inside the node instead, with no omnireduce at all)")
    if not topology.even:
        return False, f"the nodes hold different numbers of ranks ({topology.describe()}): the flat path is used"
    if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
        return False, "the process group is not the default one: the flat path is used"
    return True, f"{topology.describe()}: sum in the node, reduce across nodes by rail, share in the node"


@dataclasses.dataclass
class _Buffer:
    """One dense buffer on its way through the three steps."""

    flat: torch.Tensor  # the caller's buffer: the result is written here
    full: torch.Tensor  # ``flat``, or a padded copy of it (``L * s`` elements)
    shard: torch.Tensor  # this rank's shard of the node's sum, then of the whole sum
    cross: Cross
    divisor: int
    future: torch.futures.Future
    started: Any  # step 1's work
    pending: Any = None  # step 2's handle
    error: BaseException | None = None

    def across(self, h: Hierarchy) -> None:
        """Step 2 (the first step thread): once the node's sum is in, reduce the shard across the rail."""
        _wait(self.started, h.timeout, "the reduce-scatter inside the node")
        self.pending = self.cross(self.shard)

    def reduced(self, h: Hierarchy) -> None:
        """(The second step thread.) Wait for the rail's reduction; divide."""
        _wait(self.pending, h.timeout, "the reduction across nodes")
        if self.divisor != 1:
            self.shard.div_(self.divisor)

    def share(self, h: Hierarchy) -> torch.Tensor:
        """Step 3: every shard to every rank of the node (also after a failure: the node stays in step)."""
        work = _all_gather(self.full, self.shard, h.gather_group)
        _wait(work, h.timeout, "the all-gather inside the node")
        if self.error is None and self.full is not self.flat:
            self.flat.copy_(self.full[: self.flat.numel()])
        return self.flat


@dataclasses.dataclass
class _Rows:
    """The rows of a sparse COO tensor (``R x D``, coalesced) on their way through the three steps:
    the node's ranks gather each other's rows, and each keeps (summed) the rows of its rail
    (``row % L == local rank``); the rail reduces those across the nodes; the node's ranks gather
    the rails' results, disjoint sets of rows, into the whole sum. Every step moves rows, never the
    table."""

    tensor: torch.Tensor
    cross: Cross  # the rail's reduction of a COO tensor: a handle whose result is the reduced tensor
    divisor: int
    future: torch.futures.Future
    rail: torch.Tensor | None = None  # this rank's rail's rows, summed over the node
    result: torch.Tensor | None = None  # the rail's rows summed over every node
    pending: Any = None
    error: BaseException | None = None

    def across(self, h: Hierarchy) -> None:
        L, i = h.topology.local_size, h.topology.local_rank
        x = self.tensor
        idx, vals = _gather_rows(h.rows_group, x._indices()[0], x._values(), L, h)
        mine = idx % L == i
        rows, inverse = torch.unique(idx[mine], return_inverse=True)  # (sorted)
        summed = torch.zeros((rows.numel(), *vals.shape[1:]), dtype=torch.float32, device=vals.device)
        summed.index_add_(0, inverse, vals[mine].float())  # in rank order, each sum rounded once
        self.rail = torch.sparse_coo_tensor(rows.reshape(1, -1), summed.to(vals.dtype), tuple(x.shape),
                                            is_coalesced=True)
        self.pending = self.cross(self.rail)

    def reduced(self, h: Hierarchy) -> None:
        if self.pending is None:  # one node: the rail's rows are the sum
            self.result = self.rail
            return
        _wait(self.pending, h.timeout, "the reduction across nodes")
        self.result = _value(self.pending)

    def share(self, h: Hierarchy) -> torch.Tensor:
        x, L = self.tensor, h.topology.local_size
        if self.error is None and self.result is not None:
            res = self.result.coalesce()
            idx, vals = res._indices()[0], res._values()
        else:  # (failed: take part with no rows, so that the node stays in step)
            idx = torch.zeros(0, dtype=torch.int64, device=x.device)
            vals = torch.zeros((0, *x.shape[1:]), dtype=x.dtype, device=x.device)
        idx, vals = _gather_rows(h.gather_group, idx, vals, L, h)
        order = torch.argsort(idx)
        vals = vals[order]
        if self.divisor != 1:
            vals = (vals.float() * (1.0 / self.divisor)).to(x.dtype)
        return torch.sparse_coo_tensor(idx[order].reshape(1, -1), vals, tuple(x.shape), is_coalesced=True)


class Hierarchy:
    """The process groups of a :class:`Topology` and the three steps over them.

    Collective to create (every rank of the default group, in the same order: it creates three
    groups per node, one for each thread that issues collectives into the node, and one per rail,
    with ``timeout`` seconds for their collectives). :meth:`reduce` runs a dense buffer through the
    three steps, :meth:`reduce_rows` a sparse COO tensor; :meth:`close` ends the two step threads."""

    def __init__(self, topology: Topology, *, backend: str | None = None, timeout: float = 60.0) -> None:
        if not topology.even:
            raise ValueError(f"the hierarchy needs nodes of equal size, not {topology.describe()}")
        self.topology = topology
        self.timeout = timeout
        limit = datetime.timedelta(seconds=timeout)
        self.node_group: Any = None  # step 1 (the caller's thread)
        self.gather_group: Any = None  # step 3 (its own thread): the node's ranks again
        self.rows_group: Any = None  # step 2's gathering of sparse rows in the node (its thread)
        self.rail_group: Any = None  # step 2 (its own thread)
        local = topology.local_size
        for ranks in topology.nodes:  # every rank creates every group, in the same order
            groups = [dist.new_group(list(ranks), timeout=limit, backend=backend) for _ in range(3)]
            if topology.rank in ranks:
                self.node_group, self.gather_group, self.rows_group = groups
        for i in range(local):
            ranks = topology.rail(i)
            g = dist.new_group(list(ranks), timeout=limit, backend=backend)
            if topology.rank in ranks:
                self.rail_group = g
        self.bytes_in_node = 0  # this rank's share of what steps 1 and 3 moved inside the node
        self._failed: BaseException | None = None  # the first buffer's failure: the later ones fail at once
        self._lock = threading.Lock()
        self._to_cross: queue.Queue[_Buffer | _Rows | None] = queue.Queue()
        self._to_gather: queue.Queue[_Buffer | _Rows | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._run, args=(self._to_cross, self._cross),
                                          name="omnireduce-hier-cross", daemon=True),
                         threading.Thread(target=self._run, args=(self._to_gather, self._gather),
                                          name="omnireduce-hier-gather", daemon=True)]
        for t in self._threads:
            t.start()

    def shard_size(self, numel: int, align: int = 1) -> int:
        """Elements per shard: ``numel / L`` rounded up to a multiple of ``align``."""
        return math.ceil(numel / self.topology.local_size / align) * align if numel else 0

    def reduce(self, flat: torch.Tensor, cross: Cross, *, divisor: int = 1, align: int = 1) -> torch.futures.Future:
        """Sum contiguous ``flat`` over every rank (in place, divided by ``divisor``): step 1 now,
        the others on the step threads. Returns a future of ``flat``. ``cross(shard)`` reduces this
        rank's shard across its rail (called on a step thread, in submission order). Shards hold a
        multiple of ``align`` elements (the rail's block size: no block straddles two shards)."""
        L = self.topology.local_size
        n = flat.numel()
        done: torch.futures.Future = torch.futures.Future()
        if self._failed is not None:
            done.set_exception(_after(self._failed))
            return done
        if n == 0:  # the same on every rank: nothing to send
            done.set_result(flat)
            return done
        s = self.shard_size(n, align)
        full = flat if n == L * s else torch.zeros(L * s, dtype=flat.dtype, device=flat.device)
        if full is not flat:
            full[:n].copy_(flat)
        shard = torch.empty(s, dtype=flat.dtype, device=flat.device)
        work = _reduce_scatter(shard, full, self.node_group)
        # a ring's bytes: reduce-scatter and all-gather (L-1)/L of the buffer each; the all-reduce
        # that stands in for a missing reduce-scatter, twice that
        steps = 3 if isinstance(work, After) else 2
        with self._lock:
            self.bytes_in_node += steps * (L - 1) * s * flat.element_size()
        buf = _Buffer(flat, full, shard, cross, divisor, torch.futures.Future(), work)
        self._to_cross.put(buf)
        return buf.future

    def reduce_rows(self, x: torch.Tensor, cross: Cross, *, divisor: int = 1) -> torch.futures.Future:
        """Sum the rows of a coalesced sparse COO tensor ``x`` (``R x D``) over every rank, divided by
        ``divisor``: a future of a new coalesced COO tensor holding the rows present on some rank.
        ``cross(rail_rows)`` reduces the COO tensor of this rank's rail's rows across the rail and
        returns a handle whose result is the reduced tensor (None on one node). Nothing happens on
        the caller's thread: the rows join the buffers in submission order."""
        buf = _Rows(x.coalesce(), cross, divisor, torch.futures.Future())
        if self._failed is not None:
            buf.future.set_exception(_after(self._failed))
            return buf.future
        self._to_cross.put(buf)
        return buf.future

    def close(self) -> None:
        """End the step threads (after the buffers already submitted)."""
        for q in (self._to_cross, self._to_gather):
            q.put(None)
        for t in self._threads:
            t.join(self.timeout)

    # -- the step threads ------------------------------------------------------------------------

    def _run(self, q: queue.Queue[_Buffer | _Rows | None], step: Callable[[_Buffer | _Rows], None]) -> None:
        while True:
            buf = q.get()
            if buf is None:
                return
            step(buf)

    def _cross(self, buf: _Buffer | _Rows) -> None:
        """Step 2 of each buffer, in submission order."""
        if self._failed is not None:
            buf.error = _after(self._failed)
            self._to_gather.put(buf)
            return
        try:
            buf.across(self)
        except BaseException as e:  # step 3 still runs, so that the node's ranks stay in step
            buf.error = e
        self._to_gather.put(buf)

    def _gather(self, buf: _Buffer | _Rows) -> None:
        """Step 3: once the rail has reduced the shard, share every shard inside the node. After a
        failure, the buffers behind it fail at once: the job cannot go on, and waiting out a deadline
        per buffer would only delay the error."""
        if self._failed is not None:
            buf.future.set_exception(buf.error or _after(self._failed))
            return
        try:
            if buf.error is None:
                buf.reduced(self)
        except BaseException as e:
            buf.error = e
        result = None
        try:
            result = buf.share(self)
        except BaseException as e:
            buf.error = buf.error or e
        if buf.error is not None:
            self._failed = buf.error
            buf.future.set_exception(buf.error)
            return
        buf.future.set_result(result)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start gathering every node rank's ``inp`` into ``out`` (in local-rank order); where the backend
    has no flat all-gather for these tensors (Gloo with CUDA tensors in some releases), the list
    form into views of ``out``."""
    try:
        return _all_gather_flat(out, inp, group=group, async_op=True)
    except (RuntimeError, NotImplementedError) as e:  # raised before anything is sent, on every rank alike
        log.debug("flat all-gather unavailable (%s): the list form instead", e)
    return dist.all_gather(list(out.chunk(dist.get_world_size(group))), inp, group=group, async_op=True)


def _gather_rows(group: Any, idx: torch.Tensor, vals: torch.Tensor, L: int, h: Hierarchy
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every node rank's rows (ids and values), concatenated in local-rank order: the counts first,
    then ids and values padded to the largest count."""
    n = torch.tensor([idx.numel()], dtype=torch.int64, device=idx.device)
    counts = torch.empty(L, dtype=torch.int64, device=idx.device)
    _wait(_all_gather(counts, n, group), h.timeout, "the rows' counts inside the node")
    sizes = [int(c) for c in counts.tolist()]
    m = max(sizes)
    if m == 0:  # (the same on every rank of the node)
        return idx[:0], vals[:0]
    width = vals[0].numel() if vals.shape[0] else int(math.prod(vals.shape[1:]))
    pid = torch.zeros(m, dtype=torch.int64, device=idx.device)
    pid[: idx.numel()] = idx
    pval = torch.zeros(m * width, dtype=vals.dtype, device=vals.device)
    pval[: vals.numel()] = vals.reshape(-1)
    all_ids = torch.empty(L * m, dtype=torch.int64, device=idx.device)
    all_vals = torch.empty(L * m * width, dtype=vals.dtype, device=vals.device)
    for out, inp in ((all_ids, pid), (all_vals, pval)):
        _wait(_all_gather(out, inp, group), h.timeout, "the rows inside the node")
    keep = torch.cat([torch.arange(j * m, j * m + c, device=idx.device) for j, c in enumerate(sizes)])
    with h._lock:
        h.bytes_in_node += (L - 1) * idx.numel() * (8 + width * vals.element_size())
    return all_ids[keep], all_vals.reshape(L * m, *vals.shape[1:])[keep]


def _value(handle: Any) -> Any:
    """The result of a completed handle (a ``concurrent.futures.Future`` or a ``torch.futures.Future``)."""
    if isinstance(handle, After):
        handle = handle.work
    return handle.result() if isinstance(handle, concurrent.futures.Future) else handle.value()


def _after(error: BaseException) -> RuntimeError:
    return RuntimeError(f"an earlier bucket of the hierarchy failed ({type(error).__name__}: {error})")


def _reduce_scatter(shard: torch.Tensor, full: torch.Tensor, group: Any) -> Any:
    """Start the reduce-scatter of ``full`` into ``shard``; where the backend has none for these
    tensors, an all-reduce of ``full`` whose shard is then copied (on the step thread)."""
    try:
        return _reduce_scatter_flat(shard, full, group=group, async_op=True)
    except (RuntimeError, NotImplementedError) as e:  # raised before anything is sent, on every rank alike
        log.debug("reduce-scatter unavailable (%s): all-reduce in the node instead", e)
    work = dist.all_reduce(full, group=group, async_op=True)
    i, s = dist.get_rank(group), shard.numel()
    return After(work, lambda: shard.copy_(full[i * s: (i + 1) * s]))


class After:
    """Something to wait for (see :data:`Cross`) and a step to run once it is complete, on the
    thread that waited for it (e.g. to record what a rail's reduction measured)."""

    def __init__(self, work: Any, then: Callable[[], Any]) -> None:
        self.work, self.then = work, then


def _wait(handle: Any, timeout: float, what: str) -> None:
    """Wait for ``handle`` (see :data:`Cross`) for at most ``timeout`` seconds; raise naming ``what``."""
    if handle is None:
        return
    if isinstance(handle, After):
        _wait(handle.work, timeout, what)
        handle.then()
        return
    if isinstance(handle, concurrent.futures.Future):
        try:
            handle.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"{what} did not end within {timeout:g} s") from None
        return
    if isinstance(handle, torch.futures.Future):
        done = threading.Event()
        handle.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout):
            raise TimeoutError(f"{what} did not end within {timeout:g} s")
        # wait(), not value(): it raises the error, and a CUDA future (the collective engine's, which
        # completes on its own stream) makes this thread's stream wait for the result on the device;
        # without it the shard is read before the rail's sums are written
        handle.wait()
        return
    handle.wait(datetime.timedelta(seconds=timeout))  # a dist.Work: raises on failure or timeout
