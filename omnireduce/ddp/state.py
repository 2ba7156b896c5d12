"""The state of the DDP hook, :class:`OmniReduceState`: the user's options and, once bound, a runtime.

Design. Shaped like torch's ``PowerSGDState``: one object per DDP model, whose docstring explains
every knob. It holds three things and writes no other object's fields:

- the options (:class:`omnireduce.ddp.options.Options`): what the user set, frozen, pickled without
  the token;
- the recorder (:class:`omnireduce.ddp.recorder.Recorder`): what the paths report, pickled with
  the counts and the buckets' union densities, with the iteration and the warnings given;
- the runtime (:class:`omnireduce.ddp.runtime.Runtime`): what binding returns, never pickled. An
  unpickled state is unbound and binds again on first use.

Binding (:mod:`omnireduce.ddp.binding`) is collective over the process group; the state holds its
lock and its outcome: a failed binding stays failed, so ranks never wait for each other's retries.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import TypedDict

import torch
import torch.distributed as dist

from omnireduce.compression import BlockTopK
from omnireduce.ddp.binding import bind
from omnireduce.ddp.options import AUTO, Options
from omnireduce.ddp.recorder import Counters, Recorder
from omnireduce.ddp.residuals import Residuals, parameter_names
from omnireduce.ddp.runtime import Runtime
from omnireduce.errors import OmniReduceError
from omnireduce.worker import Worker

__all__ = ["OmniReduceState"]

log = logging.getLogger("omnireduce.ddp")


class _StatsBase(Counters):  # (HookStats in three steps: its keys in the order stats() makes them)
    density: dict[int, float]
    buckets: dict[int, dict[str, object]]
    iteration: int
    path: str
    engine: str
    collective_reductions: int
    collective_exchanges: dict[str, int]
    collective_kernel_reductions: int
    aggregators_in_use: list[str]
    hierarchical: bool
    hierarchy: str
    bytes_in_node: int
    rail_collective_reductions: int
    paths: dict[int, dict[str, object]]
    iterations_measuring: int
    step_checks: list[dict[str, object]]


class _StatsSoFar(_StatsBase, total=False):
    rail_density: dict[int, float]
    compression: dict[int, dict[str, object]]


class HookStats(_StatsSoFar):
    """What :meth:`OmniReduceState.stats` returns (its docstring explains each key): plain values only;
    ``rail_density`` where the hierarchy runs, ``compression`` with compression."""

    bytes_across_nodes: int
    sent_fraction: float


class _Residuals(TypedDict):
    residuals: dict[str, torch.Tensor]


class CompressionCheckpoint(_Residuals, total=False):
    """The compression's part of a checkpoint (:meth:`OmniReduceState.compression_state_dict`): the
    residuals by parameter name and the ``iteration``; the older format (``CompressionState.state_dict()``)
    has ``step`` and ``options`` instead."""

    iteration: int
    step: int
    options: dict[str, object]


class SavedState(TypedDict):
    """What a pickled :class:`OmniReduceState` holds."""

    options: Options
    recorder: Recorder
    iteration: int
    warned: set[str]


class OmniReduceState:
    """State of :func:`omnireduce.ddp.omnireduce_hook` for one DDP model.

    Make it anywhere: before or after ``torch.distributed`` is initialised, before or after the DDP
    model exists, then ``ddp_model.register_comm_hook(state, omnireduce_hook)``. It binds to the job
    once, collectively: the process group, this rank and the world size, the job name, the
    aggregators and this rank's :class:`omnireduce.Worker`. Made after ``init_process_group`` it
    binds at once (so make it on every rank, in the same order); made before, in the first hook
    call, which DDP makes in the same order on every rank. One state serves one DDP model: a
    bucket of a second model fails with a ``ValueError`` naming the fix (:meth:`sibling`).

    Aggregators. With addresses (``aggregators=`` or ``$OMNIREDUCE_AGGREGATORS``) the state connects
    to those. Without any, the job runs its own (:func:`omnireduce.launch.colocate.start_colocated`): one
    per node (``$OMNIREDUCE_AGGREGATORS_PER_NODE``), started by the node's lowest rank as its child,
    on the node's address (``$OMNIREDUCE_IFNAME``) and a free port, with a token rank 0 makes and
    shares through the process group; they stop with :meth:`close`, at interpreter exit, or when
    that process dies. If a node cannot start its aggregator, binding fails on every rank with an
    :class:`~omnireduce.OmniReduceError` naming the node and the cause.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        aggregators: aggregator addresses, a list or a comma-separated string (None:
            ``$OMNIREDUCE_AGGREGATORS``; neither: colocated aggregators, see above).
        job: the name the ranks of this run share at the aggregators (None: ``$OMNIREDUCE_JOB``,
            else a random name rank 0 broadcasts). Two runs must not share one on the same aggregators.
        block_size: elements per block (None: ``$OMNIREDUCE_BLOCK_SIZE`` or 256). Smaller blocks find
            more zeros but cost more per block.
        timeout: seconds each bucket may take before ``backward()`` fails with
            :class:`~omnireduce.OmniReduceTimeout`, and colocated aggregators may take to start
            (None: ``$OMNIREDUCE_TIMEOUT`` or 60).
        token: the aggregators' shared secret (None: ``$OMNIREDUCE_TOKEN``; colocated aggregators use
            the job's own). Never pickled.
        threshold: treat blocks whose elements all satisfy ``|x| <= threshold`` as zero. Lossy; 0 (exact).
        path: how each bucket picks its way, the same on every rank (docs/explanation/path-choice.md):
            ``"measure"`` (default: time the ways on the bucket, keep the fastest, check the plan on
            whole steps), ``"threshold"`` (dense once the bucket's union density reached
            ``dense_threshold``), ``"omnireduce"`` or ``"dense"`` (always that way). None:
            ``"threshold"`` when ``dense_threshold`` is given, ``"omnireduce"`` when
            ``dense_fallback=False``, else ``"measure"``.
        dense_fallback: False forces every bucket through omnireduce (``path="omnireduce"``).
        dense_threshold: the union density (fraction of a bucket's blocks non-zero on some rank) at
            and above which ``path="threshold"`` reduces a bucket densely (None: 0.6).
        engine: who sums the blocks of a bucket that takes omnireduce (docs/explanation/engines.md):
            ``"aggregators"`` (the aggregator processes), ``"collective"`` (the ranks themselves,
            through the process group's collectives on a group of the hook's own; no aggregator
            process starts and no port opens), or ``"auto"`` (default: with ``path="measure"`` on a
            Gloo or NCCL process group both engines are among the ways each bucket is timed on;
            otherwise the aggregators). Sparse COO gradients take the collective engine only when
            asked for. (Any other engine of the ranks' own registered in
            :mod:`omnireduce.engines.ways` is named and measured the same way.)
        sum_order: ``"any"`` (default): the collective engine may sum a bucket's union with the
            process group's own all-reduce, in the backend's order and precision as plain DDP does,
            where that moves the fewest bytes; ``"rank"``: every sum through omnireduce is float32
            in rank order, rounded once (the aggregators' bits, the same on every run and engine).
        measure_trials: with ``path="measure"``: timed calls of each way per measurement (3).
        remeasure_every: with ``path="measure"``: iterations between two periodic re-measurements, one
            bucket at a time (None: 2% of the iterations; 0: only when a bucket's density drifts).
        lanes, slots: protocol geometry (see :class:`omnireduce.Worker`).
        worker: an existing :class:`omnireduce.Worker` to use instead of creating one (not closed here).
        align_blocks: align each bucket's blocks to the rows of its dominant table
            (:mod:`omnireduce.ddp.alignment`). On by default.
        hierarchical: where nodes hold several ranks, reduce inside the node first, each local rank's
            shard across the nodes, then share inside the node (docs/explanation/hierarchy.md). None
            (default: ``$OMNIREDUCE_HIERARCHICAL``, ``auto``): available where there are several nodes,
            some holding more than one rank and every node as many; there, with ``path="measure"``,
            whole steps with every bucket through it are timed against flat ones (and dense), and
            the fastest kept, agreed on every rank; with another ``path`` every dense bucket takes
            it. True forces it for every dense bucket where it can run; False keeps every bucket flat.
        compression: a :class:`omnireduce.compression.BlockTopK` makes dense buckets sparse: after its
            warm-up, each bucket not already sparse (its ``exact_below``) sends only its ``density``
            largest blocks, the rest kept for later steps (error feedback), the same blocks on every
            rank (its ``selection``: ``"shared"`` all-reduces the blocks' scores first, ``"stale"``
            takes the previous step's, carried behind its values); their way (aggregators, collective
            engine, dense all-reduce, or the whole bucket uncompressed where compressing does not pay)
            is measured like any bucket's, through the hierarchy where the dense buckets take it
            (docs/howto/compression.md). Lossy, like any compression: ``density=1`` gives plain DDP's
            result. Residuals: :meth:`compression_state_dict`.
        grad_scaler: with ``compression`` and loss scaling, the ``torch.amp.GradScaler``: residuals are
            then kept unscaled, so a changing scale never mixes scales in them (its scale is read on the
            device, never on the host). Not pickled.

    Sparse gradients (``nn.Embedding(sparse=True)``) are reduced through omnireduce whatever the
    process group's backend, one block per touched row (:mod:`omnireduce.ddp.paths.coo`).

    The state can be pickled (inside a checkpoint, or by a launcher that spawns processes): its
    options without the token, its counters, densities and iteration; not its sockets, processes or
    process group.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, aggregators: str | list[str] | None = None,
                 *, job: str | None = None, block_size: int | None = None, timeout: float | None = None,
                 token: str | None = None, threshold: float = 0.0, dense_fallback: bool = True,
                 dense_threshold: float | None = None, lanes: int | None = None, slots: int | None = None,
                 worker: Worker | None = None, align_blocks: bool = True, hierarchical: bool | None = None,
                 path: str | None = None, measure_trials: int = 3, remeasure_every: int | None = None,
                 engine: str = "auto", compression: BlockTopK | None = None,
                 grad_scaler: torch.amp.GradScaler | None = None,
                 sum_order: str = "any") -> None:
        options = Options.resolve(
            aggregators=aggregators, job=job or None, block_size=block_size, timeout=timeout, token=token,
            threshold=threshold, lanes=lanes, slots=slots, path=path, dense_fallback=dense_fallback,
            dense_threshold=dense_threshold, measure_trials=measure_trials, remeasure_every=remeasure_every,
            align_blocks=align_blocks, hierarchical=hierarchical, engine=engine, compression=compression,
            sum_order=sum_order)
        self._start(options, process_group, worker)
        self.grad_scaler = grad_scaler
        if dist.is_available() and dist.is_initialized():
            self.bind()

    def _start(self, options: Options, process_group: dist.ProcessGroup | None, worker: Worker | None,
               parent: OmniReduceState | None = None, number: int = 0) -> None:
        """Every field: the options, a fresh recorder, no runtime (a sibling: its parent and number)."""
        self.options, self.process_group, self._given_worker = options, process_group, worker
        self._parent, self._number = parent, number
        self.recorder = Recorder()
        self.residuals = Residuals(options.compression) if options.compression is not None else None
        self.grad_scaler = None  # (not pickled: the user's object)
        self._iteration = 0  # completed iterations until bound (then the runtime's intake counts them)
        self._warned: set[str] = set()
        self._runtime: Runtime | None = None
        self._bind_lock = threading.RLock()
        self._bind_error: BaseException | None = None
        self._closed = False
        self._siblings = 0  # siblings made so far (each one's job is this one's with its number)

    # -- binding -------------------------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        """Whether the state has bound to the job."""
        return self._runtime is not None

    def bind(self) -> Runtime:
        """Bind to the job now, if not yet bound (collective over the process group: every rank calls
        it in the same order; the hook does on its first call). A failed binding stays failed: later
        calls raise the same error at once, without any collective."""
        runtime = self._runtime
        if runtime is not None and not self._closed:
            return runtime
        with self._bind_lock:
            if self._closed:
                raise OmniReduceError("this OmniReduceState is closed")
            if self._runtime is not None:
                return self._runtime
            if self._bind_error is not None:
                raise OmniReduceError(f"omnireduce could not start: {self._bind_error}") from self._bind_error
            try:
                self._runtime = bind(self._bound_options(), self.process_group, self._given_worker, self.recorder,
                                     self.warn_once, self.residuals, self.grad_scaler, iteration=self._iteration)
            except BaseException as e:
                self._bind_error = e
                raise
            return self._runtime

    def _bound_options(self) -> Options:
        """The options to bind with: a sibling takes its parent's aggregators and token."""
        parent = self._parent
        if parent is None:
            return self.options
        rt = parent.bind()
        job = f"{rt.job}.m{self._number}"  # (its own tensor sequence, never the parent's)
        if rt.worker is None:  # (the parent's job has no aggregators: the collective engine)
            return dataclasses.replace(self.options, job=job)
        return dataclasses.replace(self.options, job=job, aggregators=rt.worker.config.aggregators,
                                   token=rt.worker.config.token)

    def sibling(self) -> OmniReduceState:
        """A new state with these options for another DDP model of the same job (TorchRec's data-parallel
        tables beside its dense layers, say), sharing this state's aggregators (its colocated ones
        included) under a job name of its own (this one's with ``.m1``, ``.m2``, ...), so the models'
        tensors never mix; with ``engine="collective"``, an engine of its own. Make siblings in the same
        order on every rank; close them before this one (at interpreter exit they leave first)."""
        self._siblings += 1
        state = OmniReduceState.__new__(OmniReduceState)
        state._start(self.options, self.process_group, None, parent=self, number=self._siblings)
        state.grad_scaler = self.grad_scaler
        if self.bound:
            state.bind()
        return state

    def compression_state_dict(self, model: torch.nn.Module) -> CompressionCheckpoint:
        """The error-feedback residuals by ``model``'s parameter names (float32 CPU tensors), for a
        checkpoint beside the model's and the optimizer's (between steps; ``compression`` only)."""
        return {"iteration": self.iteration, "residuals": self._residuals().state_dict(parameter_names(model))}

    def load_compression_state_dict(self, model: torch.nn.Module, saved: CompressionCheckpoint) -> None:
        """Restore :meth:`compression_state_dict` into this (fresh) state before training resumes: the
        residuals, and the iteration count, so that no new warm-up runs. Takes the older checkpoint
        format ``{"step", "options", "residuals"}`` too (its ``step`` is the iteration)."""
        self._residuals().load_state_dict(parameter_names(model), saved["residuals"])
        self.iteration = int(saved["iteration"] if "iteration" in saved else saved["step"])

    def _residuals(self) -> Residuals:
        if self.residuals is None:
            raise ValueError("this OmniReduceState has no compression: OmniReduceState(compression=BlockTopK(...))")
        return self.residuals

    def close(self, *, drain: bool = True) -> None:
        """Leave the job and stop the colocated aggregators this process started, once the other
        ranks' workers have left them too (``drain``; at most a few seconds). With ``drain``, first waits
        (at most ``timeout``) for the last iteration's agreement, an all-reduce on the process group, so
        that ``dist.destroy_process_group()`` after it leaves nothing of omnireduce's queued. Idempotent;
        runs at interpreter exit for a state with colocated aggregators. A worker given as ``worker=`` is
        left open."""
        with self._bind_lock:
            self._closed = True
            runtime = self._runtime
            if runtime is not None:
                runtime.close(drain=drain)

    # -- what the hook calls ---------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        """Iterations completed (DDP's last bucket ends one)."""
        runtime = self._runtime
        return runtime.intake.iteration if runtime is not None else self._iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self._iteration = int(value)
        if self._runtime is not None:
            self._runtime.intake.iteration = self._iteration

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # -- what the user reads ---------------------------------------------------------------------------

    path = property(lambda self: self.options.path, doc="How buckets pick their way (the ``path`` knob, resolved).")
    engine = property(lambda self: self.options.engine, doc="The ``engine`` knob.")
    rank = property(lambda self: None if self._runtime is None else self._runtime.rank, doc="This rank (bound).")
    world_size = property(lambda self: None if self._runtime is None else self._runtime.world_size,
                          doc="The world size (bound).")
    block_size = property(lambda self: None if self._runtime is None else self._runtime.config.block_size,
                          doc="Elements per block, every engine's (bound).")
    worker = property(lambda self: None if self._runtime is None else self._runtime.worker,
                      doc="This rank's omnireduce.Worker (None: unbound, or no aggregators).")
    colocated = property(lambda self: None if self._runtime is None else self._runtime.colocated,
                         doc="The job's own aggregators this process started (None otherwise).")

    @property
    def job(self) -> str | None:
        """The job's name at the aggregators (None until bound, unless given)."""
        return self._runtime.job if self._runtime is not None else self.options.job

    def stats(self) -> HookStats:
        """What the hook has done since the state was made.

        ``bytes_sent`` / ``bytes_received``: this rank's bytes for all buckets (dense buckets at a ring
        all-reduce's ``2 (W-1)/W``); ``dense_equivalent_bytes``: a ring all-reduce of every bucket;
        ``sent_fraction``; ``buckets_sparse`` / ``buckets_dense`` / ``buckets_failed`` / ``buckets_coo`` /
        ``buckets_probed``; ``density``: the last union density per bucket index; ``buckets``: per
        bucket index, its last reduction's way and bytes (through the hierarchy: its rail's); ``iteration``;
        ``path``; ``paths``: per bucket, the path choice's decision and timings; ``step_checks``;
        ``iterations_measuring``; ``engine`` (``aggregators``, ``collective`` or ``measured``);
        ``collective_reductions``; ``collective_exchanges`` (how many of them each exchange of the
        engine carried: ``gather``, ``union``, ``owners``, ``dense`` (the whole bucket's all-reduce
        after the bitmaps, where nearly every block is non-zero), and ``whole`` for buckets small
        enough to take the dense all-reduce before any bitmap, which count among ``buckets_dense``);
        ``collective_kernel_reductions`` (those the kernel exchange carried: ``OMNIREDUCE_ENGINE_KERNELS``);
        ``aggregators_in_use``;
        ``hierarchical`` (the hierarchy runs);
        ``hierarchy`` (``"on"``: every dense bucket takes it, ``"off"``, ``"measured"``: per bucket,
        its ``paths`` entry names ``"hier:..."`` or a flat way); ``bytes_in_node``;
        ``bytes_across_nodes``; ``rail_collective_reductions``; ``rail_density`` (hierarchical);
        ``compression`` (with ``compression``: per compressed bucket index, its blocks, ``k``, density
        sent, union, residual norm and compressed steps; reading the norms synchronises on CUDA)."""
        counters = self.recorder.counters.snapshot()
        out: _StatsSoFar = {
            **counters, "density": self.recorder.densities.latest(), "buckets": self.recorder.buckets(),
            "iteration": self.iteration, "path": str(self.options.path),
            "engine": "measured" if self.options.engine == AUTO else self.options.engine, "collective_reductions": 0,
            "collective_exchanges": {}, "collective_kernel_reductions": 0,
            "aggregators_in_use": [], "hierarchical": False, "hierarchy": "off", "bytes_in_node": 0,
            "rail_collective_reductions": 0, "paths": {}, "iterations_measuring": 0, "step_checks": []}
        runtime = self._runtime
        if runtime is not None:
            out.update(runtime.stats())
        if self.residuals is not None:
            out["compression"] = self.residuals.stats()
        sent, dense = counters["bytes_sent"], counters["dense_equivalent_bytes"]
        return {**out, "bytes_across_nodes": sent, "sent_fraction": sent / dense if dense else 0.0}

    # -- pickling: the options (without the token), the recorder, the iteration, the warnings -----------

    def __getstate__(self) -> SavedState:
        return {"options": self.options, "recorder": self.recorder, "iteration": self.iteration,
                "warned": set(self._warned)}

    def __setstate__(self, saved: SavedState) -> None:
        self._start(saved["options"], None, None)
        self.recorder, self.iteration, self._warned = saved["recorder"], saved["iteration"], saved["warned"]

