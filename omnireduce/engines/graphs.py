"""CUDA graphs of the collective engine's steady state: a sparse bucket's fused reduction captured once
and replayed, one launch instead of a handful (``OMNIREDUCE_CUDA_GRAPHS=1``; off by default).

Design. A bucket whose last reduction went ``gather`` is next reduced fused
(:class:`omnireduce.engines.plan.History`): the kernel exchange's ``record``, one all-gather of every
rank's record, ``counts``, and the sums (:mod:`omnireduce.engines.exchange_kernels`). With its
layout and the all-gather's capacity known, :class:`Graphs` captures all of it on the engine's side
stream, the NCCL all-gather included, into buffers the graph owns: this rank's record and every
rank's, the bitmaps, prefix sums and counts, and a pinned host copy of the counts, which the graph
writes itself. The sums it captures are guarded (``sum_blocks_within``): a kernel that reads the
counts on the device and writes nothing if some rank had more blocks than the capacity. A replay is
then one ``cudaGraphLaunch``, one event, and a poll of it with the group's deadline
(:func:`omnireduce.engines.waits.poll`), after which the host reads the counts as the uncaptured
path does. If the capacity was short (the same on every rank: each sees every count) the bucket is
still untouched, and the reduction finishes exactly as the uncaptured fused path does after its
counts: the rest of the blocks in a second all-gather, then the sums
(:func:`omnireduce.engines.exchange_kernels.finish`'s gather). Same collectives, same sizes, same
bits.

Which reductions: :mod:`omnireduce.engines.graph_book` (the preconditions and the book: a key's first
reduction uncaptured, its second captured, then replays; at most 16 graphs, least recently used let
go first). A graph is bound to the bucket's memory: captured on the bucket itself (its address in
the key), no copy in or out. Anything else takes the uncaptured path, and so does every reduction
after a capture fails (logged once). The graphs go with the engine's thread (:meth:`Graphs.close`).

Captures use ``capture_error_mode="thread_local"``: DDP's autograd thread keeps launching work on
other streams while the engine's thread captures. The NCCL all-gather is captured through the
process group as any collective (NCCL mixes captured and uncaptured work on one communicator by
default); ProcessGroupNCCL's watchdog does not watch a graph's collectives, the poll's deadline does.

The device's part is a backend (:class:`CudaGraphs`); tests give a stand-in that runs the same
steps on CPU tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from omnireduce.engines import exchange_kernels
from omnireduce.engines.exchange_device import Outcome, _all_gather, _Bucket, _record, _Reduction, _rows_of
from omnireduce.engines.graph_book import Action, GraphBook, GraphKey, overflowed, refusal
from omnireduce.engines.plan import Counts, Exchange, Step
from omnireduce.engines.waits import poll
from omnireduce.engines.workspace import Workspace
from omnireduce.envvars import env

log = logging.getLogger("omnireduce.collective")

LIMIT = 16
"""Graphs an engine keeps at most (each holds W + 1 of its bucket's records, its own and every rank's,
and the bitmaps)."""
_WHAT = "the blocks' counts"
_SETTINGS = ("the torch ops' way", "kernels without", "the process group waits", "a lossy threshold")
"""Refusals (:func:`~omnireduce.engines.graph_book.refusal`) that settings cause: warned about once."""


def enabled() -> bool:
    """``OMNIREDUCE_CUDA_GRAPHS``: ``1`` captures the collective engine's steady-state reductions as CUDA
    graphs; ``0`` (the default) never."""
    raw = (env("OMNIREDUCE_CUDA_GRAPHS") or "0").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"OMNIREDUCE_CUDA_GRAPHS must be 0 or 1, got {raw!r}")
    return raw == "1"


def host_waits() -> bool:
    """Whether the process group waits for its collectives on the host (``TORCH_NCCL_BLOCKING_WAIT``, or
    its older name ``NCCL_BLOCKING_WAIT``): a capture cannot hold such a wait."""
    return any((env(name) or "0").strip().lower() in ("1", "true", "yes")
               for name in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"))


@dataclasses.dataclass
class Statics:
    """What a captured reduction leaves where the host finds it after each replay (a graph's own
    buffers), and its collectives' tally (the same every replay)."""

    own_prefix: torch.Tensor  # this rank's bitmap's prefix sums (record's)
    gathered: torch.Tensor  # every rank's record, [W, bytes]
    bits: torch.Tensor  # every rank's bitmap and their union, [W + 1, nbytes]
    prefix: torch.Tensor
    counts: torch.Tensor  # on the device; the host's copy is the entry's
    sent: int = 0
    collectives: int = 0


@dataclasses.dataclass
class Entry:
    """One graph: the backend's handle, its statics, the pinned counts it writes, and its record's geometry."""

    handle: Any
    statics: Statics
    host: torch.Tensor
    head: int
    scale: float
    workspace: Workspace  # (its record's buffers: the graph's, never another's)


class GraphBackend(Protocol):
    """The device's part of :class:`Graphs`: capture, replay, wait, free."""

    device_type: str

    def host_buffer(self, n: int) -> torch.Tensor:
        """``n`` int64s the host reads after a replay (pinned), made before any capture."""
        ...

    def capture(self, run: Callable[[torch.Tensor], Statics], flat: torch.Tensor) -> tuple[Any, Statics]:
        """``run(flat)``'s device work captured as a graph, then run once; the handle and the statics."""
        ...

    def replay(self, handle: Any, flat: torch.Tensor) -> None: ...

    def wait(self, device: torch.device, timeout: float | None) -> None:
        """Until what the current stream has been given so far is done (with the deadline)."""
        ...

    def release(self, handle: Any) -> None: ...


class CudaGraphs:
    """:class:`GraphBackend` on CUDA: ``torch.cuda.CUDAGraph`` on the current stream (the engine's side
    stream), one memory pool per engine (its graphs replay one after the other, on one stream, and
    each rewrites its buffers before the host reads them)."""

    device_type = "cuda"

    def __init__(self) -> None:
        self._pool: Any = None
        self._done: dict[torch.device, Any] = {}  # (one event per device, recorded after each replay)

    def host_buffer(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.int64, pin_memory=True)

    def capture(self, run: Callable[[torch.Tensor], Statics], flat: torch.Tensor) -> tuple[Any, Statics]:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        try:
            statics = run(flat)
        except BaseException:
            with contextlib.suppress(Exception):  # (ends the capture; the graph is dropped)
                graph.capture_end()
            raise
        graph.capture_end()
        graph.replay()
        return graph, statics

    def replay(self, handle: Any, flat: torch.Tensor) -> None:
        handle.replay()

    def wait(self, device: torch.device, timeout: float | None) -> None:
        done = self._done.get(device)
        if done is None:
            done = self._done[device] = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        poll(done, timeout, _WHAT)

    def release(self, handle: Any) -> None:
        handle.reset()


class Graphs:
    """The collective engine's CUDA graphs (see the module): :meth:`reduce` carries a reduction where
    :func:`~omnireduce.engines.graph_book.refusal` and the book let it, else returns None and the
    engine reduces as it would have. Only the engine's thread calls it."""

    def __init__(self, group: Any, rank: int, world: int, timeout: float | None, workspace: Workspace,
                 threshold: float = 0.0, backend: GraphBackend | None = None, limit: int = LIMIT) -> None:
        self.group, self.rank, self.world, self.timeout = group, rank, world, timeout
        self.workspace, self.threshold = workspace, threshold  # (the engine's: only what a fallback sends)
        self.backend: GraphBackend = backend if backend is not None else CudaGraphs()
        self.book: GraphBook[Entry] = GraphBook(limit)
        self._host_waits = host_waits()
        self._said: set[str] = set()

    def reduce(self, flat: torch.Tensor, block_size: int, *, kernels: Any, step: Step, average: bool,
               total_lanes: int, pairs: bool) -> Outcome | None:
        """Reduce ``flat`` in place through a graph, as :func:`omnireduce.engines.exchange_kernels.reduce`
        would with these arguments (the same collectives, counts and bits), or None where no graph
        carries it (the engine then reduces it uncaptured)."""
        why = refusal(device_type=flat.device.type, graph_device=self.backend.device_type, threshold=self.threshold,
                      kernels=kernels, fused=step.fused, world=self.world, max_world=exchange_kernels._MAX_WORLD,
                      host_waits=self._host_waits, broken=self.book.broken)
        if why is not None:
            if why not in self._said:  # (once per reason; a warning where the settings rule graphs out)
                self._said.add(why)
                log.log(logging.WARNING if why.startswith(_SETTINGS) else logging.DEBUG,
                        "omnireduce: OMNIREDUCE_CUDA_GRAPHS=1, but no CUDA graph for this reduction: %s", why)
            return None
        key = GraphKey(str(flat.device), flat.data_ptr(), flat.numel(), str(flat.dtype), block_size, step.capacity,
                       self.world, total_lanes, pairs, average)
        action = self.book.plan(key)
        if action is Action.RUN:
            return None
        if action is Action.CAPTURE:
            entry = self._capture(key, flat, kernels)
            if entry is None:
                return None
        else:
            entry = self.book.graph(key)
            self.backend.replay(entry.handle, flat)
        return self._finish(key, entry, flat, kernels)

    def _capture(self, key: GraphKey, flat: torch.Tensor, kernels: Any) -> Entry | None:
        """Capture ``key``'s steps and run them once (None: the capture failed; graphs are off from now on)."""
        for old in self.book.make_room():  # (freed before the capture begins, never inside it)
            self.backend.release(old.handle)
        workspace = Workspace()
        host = self.backend.host_buffer(key.world + 2 + (key.world * key.world + key.world if key.pairs else 0))
        scale = 1.0 / key.world if key.average and key.world > 1 else 1.0
        b = _Bucket(flat, key.block_size)
        head, size = _record(-(-b.nb // 8), key.capacity, b)

        def run(x: torch.Tensor) -> Statics:
            return _steps(x, kernels, workspace, host, key, head, size, scale, self.group, self.rank)

        try:
            handle, statics = self.backend.capture(run, flat)
        except Exception as e:  # (the reduction then runs uncaptured; the others too, from now on)
            reason = f"{type(e).__name__}: {e}"
            log.warning("omnireduce: the collective engine could not capture a CUDA graph of a reduction (%s); "
                        "its reductions run uncaptured from now on", reason)
            for old in self.book.fail(reason):
                self.backend.release(old.handle)
            return None
        entry = Entry(handle, statics, host, head, scale, workspace)
        self.book.captured(key, entry)
        return entry

    def _finish(self, key: GraphKey, entry: Entry, flat: torch.Tensor, kernels: Any) -> Outcome:
        """After a replay: the counts (the one wait), and where the capacity was short the rest of the
        blocks and the sums, uncaptured (the graph's sums wrote nothing then)."""
        s = entry.statics
        w0 = time.thread_time()
        self.backend.wait(flat.device, self.timeout)
        counts = Counts.from_flat(entry.host.tolist(), self.world)
        wait_s = time.thread_time() - w0
        over = overflowed(counts.nonzero, key.capacity)
        sent, collectives = s.sent, s.collectives
        if over:
            r = _Reduction(_Bucket(flat, key.block_size), self.group, self.rank, self.world, 0.0, self.workspace)
            exchange_kernels._gather(kernels, r, counts, s.gathered, s.bits, s.prefix, s.own_prefix, entry.head,
                                     key.capacity, entry.scale)
            sent, collectives = sent + r.sent, collectives + r.collectives
        self.book.replayed(over)
        return Outcome(Exchange.GATHER, counts, True, over, sent, sent, collectives, 1, wait_s)

    def counters(self) -> dict[str, int]:
        """``graph_captures``, ``graph_replays`` (reductions a graph carried), ``graph_fallbacks`` (those
        whose capacity was short, finished uncaptured), ``graph_failures`` (captures that failed) and
        ``graphs`` (held now)."""
        return dict(self.book.counts, graphs=len(self.book))

    def close(self) -> None:
        """Free every graph and let go of the group (the engine's thread, at its end)."""
        for entry in self.book.close():
            self.backend.release(entry.handle)
        self.group = None


def counters(graphs: Graphs | None) -> dict[str, int]:
    """:meth:`Graphs.counters`, zeros where the engine keeps no graphs."""
    if graphs is None:
        return {"graph_captures": 0, "graph_replays": 0, "graph_fallbacks": 0, "graph_failures": 0, "graphs": 0}
    return graphs.counters()


def _steps(x: torch.Tensor, kernels: Any, workspace: Workspace, host: torch.Tensor, key: GraphKey, head: int,
           size: int, scale: float, group: Any, rank: int) -> Statics:
    """A fused reduction's device work with nothing read on the host: ``exchange_kernels.reduce``'s
    record, all-gather and counts, the counts copied to ``host``, and the guarded sums."""
    b = _Bucket(x, key.block_size)
    r = _Reduction(b, group, rank, key.world, 0.0, workspace)
    own: list[torch.Tensor] = []

    def fill(record: torch.Tensor) -> None:
        own.append(kernels.record(x, b.B, 0.0, record.view(-1), head, key.capacity))

    parts = _all_gather(workspace, "gathered", (size,), torch.uint8, fill, r, slack=False)
    gathered = exchange_kernels._rows(parts, kernels)
    if not isinstance(gathered, torch.Tensor):  # (kernels that take the parts as a list have no guarded sum)
        raise TypeError("a graph's kernels take every rank's record as one tensor")
    bits, prefix, counts = kernels.counts(gathered, b.nb, key.total_lanes, key.pairs)
    host.copy_(counts, non_blocking=True)
    first = _rows_of(gathered, head, key.capacity, b.B, x.dtype)
    kernels.sum_blocks_within(x, b.B, bits, prefix, key.world, 0, key.world, first, None, scale, counts, key.capacity)
    return Statics(own[0], gathered, bits, prefix, counts, r.sent, r.collectives)
