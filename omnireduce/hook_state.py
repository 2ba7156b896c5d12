"""The state of the DDP hook, :class:`OmniReduceState`: one object per DDP model, its fields declared once.

Design. Shaped like torch's ``PowerSGDState``: the state holds everything the hook reads or
writes, and its docstring explains every knob. Its fields are declared once, as dataclass fields
(``dataclasses.fields(OmniReduceState)``), each in one of four groups:

- knobs: what the user sets (the constructor's arguments);
- binding: what binding to the job resolves or opens: the rank, the world size, the worker, the
  colocated aggregators, the ranks' agreement on which aggregators to use
  (:mod:`omnireduce.membership`), the binding's own lock and outcome;
- decisions: what steers each bucket's path: its union densities
  (:class:`omnireduce.hook_decisions.BucketDecisions`), its timings of both paths and the path
  agreed (:class:`omnireduce.path_choice.PathChoice`), and the sparse COO buckets of the backward
  pass in progress (:class:`omnireduce.hook_coo.CooBatch`);
- counters: the iteration, :class:`omnireduce.hook_counters.HookCounters`, the warnings given.

Pickling is derived from that declaration: every field is pickled except binding fields and those
declared ``pickled=False``, and a field may declare what it pickles as (the worker options without
the token). Unpickling gives every field not in the pickle its declared default, so an unpickled
state is unbound and binds again on first use. Binding itself (resolving the process group, rank,
job name, aggregators and worker) is in :mod:`omnireduce.hook_binding`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import field
from typing import Any

import torch.distributed as dist

from omnireduce.collective import CollectiveEngine
from omnireduce.colocate import Colocated
from omnireduce.config import env_hierarchical
from omnireduce.errors import OmniReduceError
from omnireduce.hook_binding import connect, job_name
from omnireduce.hook_coo import CooBatch
from omnireduce.hook_counters import HookCounters, ring_bytes
from omnireduce.hook_decisions import BucketDecisions, BucketKey, DeviceDensity, probe_dense
from omnireduce.hook_hierarchy import HierarchicalPath
from omnireduce.hook_hierarchy import bind as bind_hierarchy
from omnireduce.membership import Agreement
from omnireduce.path_choice import COLLECTIVE, DENSE, MODES, OMNIREDUCE, PathChoice, Trial
from omnireduce.worker import Worker

__all__ = ["OmniReduceState"]

log = logging.getLogger("omnireduce.ddp")

KNOB, BINDING, DECISION, COUNTER = "knob", "binding", "decision", "counter"
ENGINES = ("auto", "aggregators", "collective")


def sparse_paths(engine: str, path: str, backend: str) -> tuple[str, ...]:
    """The ways through omnireduce a state's buckets may take, given its ``engine`` and ``path``
    knobs and its process group's backend: the aggregators (``"omnireduce"``), the collective
    engine (``"collective"``), or (``engine="auto"`` measuring on Gloo) both, measured against each
    other and the dense all-reduce. On other backends (NCCL) ``"auto"`` keeps to the aggregators:
    the collective engine's CUDA path has run on one GPU through Gloo, never over NCCL (a GPU per
    rank); ask for it with ``engine="collective"``."""
    if engine == "collective":
        return (COLLECTIVE,)
    if engine == "auto" and path == "measure" and "gloo" in backend.lower():
        return (OMNIREDUCE, COLLECTIVE)
    return (OMNIREDUCE,)


def _release_at_exit(ref: weakref.ref[Agreement]) -> None:
    """At interpreter exit: the last agreement's work is let go while the interpreter still runs (a
    Gloo work destroyed during the shutdown can abort the process)."""
    agreement = ref()
    if agreement is not None:
        agreement.release()


def _meta(group: str, *, pickled: bool = True, pickle_as: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """A state field's declaration, as its ``dataclasses.field`` metadata: its group, whether it is
    pickled (a binding field never is) and, optionally, what it is pickled as."""
    return {"group": group, "pickled": pickled and group != BINDING, "pickle_as": pickle_as}


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _without_token(options: dict[str, Any]) -> dict[str, Any]:
    """No secret in checkpoints: after unpickling the token comes from the environment again."""
    return {**options, "token": None}


@dataclasses.dataclass(init=False, repr=False, eq=False)
class OmniReduceState:
    """State of :func:`omnireduce.ddp.omnireduce_hook` for one DDP model.

    Make it anywhere: before or after ``torch.distributed`` is initialised, before or after the DDP
    model exists (PyTorch Lightning builds ``DDPStrategy(ddp_comm_state=OmniReduceState(), ...)``
    before it initialises the process group), then ``ddp_model.register_comm_hook(state,
    omnireduce_hook)``. The state binds to the job once: it resolves the process group, this rank and
    the world size, the job name (rank 0 makes one up and broadcasts it) and the aggregators, and
    connects its :class:`omnireduce.Worker`. Binding is collective over the process group. Made
    after ``init_process_group``, the state binds at once, as it is made (so make it on every rank,
    in the same order); made before, it binds in the first hook call, which DDP makes in the same
    order on every rank. :meth:`bind` binds it explicitly.

    Aggregators. With addresses (``aggregators=`` or ``$OMNIREDUCE_AGGREGATORS``) the state
    connects to those. Without any, the job runs its own (:func:`omnireduce.colocate.start_colocated`):
    ``$OMNIREDUCE_AGGREGATORS_PER_NODE`` (default 1) aggregator processes per node, started by the
    node's lowest rank as its children, on the node's address the other nodes reach
    (``$OMNIREDUCE_IFNAME`` to choose the interface), on free ports, with a fresh token rank 0 makes
    and shares through the process group. They stop with :meth:`close`, at interpreter exit, or
    when the process that started them dies (SIGKILL included). If some node cannot start its
    aggregator, binding fails on every rank with an :class:`~omnireduce.OmniReduceError` naming the
    node and the cause (from the hook: ``backward()`` raises it).

    Args:
        process_group: the group DDP reduces over (None: the default group). Its rank and size
            are this worker's rank and world size; the dense fallback all-reduces through it.
        aggregators: aggregator addresses, a list or a comma-separated string
            (None: ``$OMNIREDUCE_AGGREGATORS``; neither: colocated aggregators, see above).
        job: name shared by the ranks of this training run at the aggregators (None:
            ``$OMNIREDUCE_JOB``, else a random name that rank 0 broadcasts). Two runs must not
            share a name on the same aggregators.
        block_size: elements per block (None: ``$OMNIREDUCE_BLOCK_SIZE`` or 256). Smaller blocks
            find more zeros (an embedding row of 64 floats is a quarter of a 256-block) but cost
            more per block.
        timeout: seconds each bucket may take before backward() fails with
            :class:`~omnireduce.OmniReduceTimeout`, and colocated aggregators may take to start
            (None: ``$OMNIREDUCE_TIMEOUT`` or 60).
        token: the aggregators' shared secret (None: ``$OMNIREDUCE_TOKEN``; colocated aggregators
            use the job's own).
        threshold: treat blocks whose elements all satisfy ``|x| <= threshold`` as zero. Lossy;
            0 (exact) by default.
        path: how each dense bucket picks between omnireduce and the process group's own
            all-reduce (the same on every rank, always):

            - ``"measure"`` (the default): by timing both on the bucket itself
              (:mod:`omnireduce.path_choice`). After DDP's bucket rebuild each bucket takes the two
              paths on alternate iterations (one untimed call of each, then ``measure_trials``
              timed ones; timed from the hook's call to its future's completion, with CUDA events
              on a GPU, read later, never waited for), the ranks agree on the slowest rank's
              medians (riding the per-iteration all-reduce the hook makes anyway), and the faster
              path wins. A plan that sends buckets through omnireduce is then checked on whole
              steps: ``measure_trials`` steps of it against as many with those buckets dense, on
              alternate iterations; it stays only if its steps are faster (omnireduce's CPU and
              device time is felt by the rest of the step, not by the bucket's own timing). A
              bucket is measured again, one bucket at a time, when its union density drifts
              by more than 2x, and round robin one bucket every ``remeasure_every`` iterations.
              A bucket decided dense costs nothing per step (no scan of its gradient).
            - ``"threshold"``: the union-density rule: dense once the bucket's last union density
              reached ``dense_threshold``. A host bucket seen for the first time (the first
              iteration, and after DDP rebuilds its buckets) has no union density yet: the ranks
              all-reduce their local densities (MAX, one number; the union is at least the
              largest), so that a dense bucket goes dense from its first iteration.
            - ``"omnireduce"``, ``"dense"``: always that path.

            None: ``"threshold"`` when ``dense_threshold`` is given, ``"omnireduce"`` when
            ``dense_fallback=False``, else ``"measure"``.
        dense_fallback: False forces every bucket through omnireduce (``path="omnireduce"``).
        dense_threshold: with ``path="threshold"``: the union density (fraction of a bucket's blocks
            non-zero on some rank) at and above which a bucket is reduced densely (None: 0.6).
            Where omnireduce and Gloo cost the same depends on the network and the aggregators
            (docs/BENCHMARKS.md, 4 ranks, 100 MiB): about 0.75 on loopback, 0.35 with one
            aggregator and 0.85 with four on 1 Gbit/s links.
        engine: who sums the blocks of a bucket that takes omnireduce: ``"aggregators"`` (the
            aggregator processes, over omnireduce's own transport) or ``"collective"`` (the ranks
            themselves, each owning a share of the slots, through the process group's collectives on
            a group of the hook's own: one all-gather of block bitmaps and two all-to-alls per
            bucket, :mod:`omnireduce.collective`; the same bits as the aggregators; on CUDA
            tensors the blocks stay on the device and NCCL moves them; the hierarchy's rails use
            it too, and sparse COO gradients by rows). ``"auto"`` (default): with
            ``path="measure"`` on a Gloo process group, both engines are among the paths each
            bucket is timed on (with the dense all-reduce: 3 paths, a measurement spans
            ``3 (1 + measure_trials)`` iterations), and each bucket keeps the fastest; sparse COO
            gradients go to the aggregators. Otherwise (NCCL, or another ``path``), the
            aggregators: the collective engine's CUDA path has run on one GPU through Gloo but
            never over NCCL, so on a GPU cluster it is taken only when asked for.
        measure_trials: with ``path="measure"``: timed calls of each path per measurement (3).
        remeasure_every: with ``path="measure"``: iterations between two periodic
            re-measurements, one bucket at a time (each spans ``P (1 + measure_trials)`` iterations
            for ``P`` paths, and ``2 measure_trials`` more when a bucket goes back to omnireduce and
            the plan is checked on whole steps; None, the default: 50 times a measurement's span, so
            that 2% of the iterations measure: 400 with two paths, 600 with three; 0: only on
            drift).
        lanes, slots: protocol geometry (see :class:`omnireduce.Worker`).
        worker: an existing :class:`omnireduce.Worker` to use instead of creating one (the state
            does not close it).
        align_blocks: per dense bucket, align the blocks to the rows of its dominant table: the
            block size becomes the largest multiple of their width up to ``block_size`` (a 200-wide
            embedding gets blocks of 200, not 256, so a touched row is one block, not two;
            ``block_size=16`` with 16-wide rows: one row per block; :mod:`omnireduce.alignment`).
            On by default (measured: docs/BENCHMARKS.md).
        hierarchical: where nodes hold several ranks, reduce each dense bucket in three steps:
            reduce-scatter inside the node, each local rank's shard across the nodes through
            omnireduce (local rank ``i`` of every node forms rail ``i``, its own omnireduce job at
            the same aggregators, with its own dense/sparse decision), all-gather inside the node
            (:mod:`omnireduce.hierarchy`). A node sends each block of its sum once instead of once
            per rank, and the steps inside the node use the process group's backend (NVLink with
            NCCL). None (default: ``$OMNIREDUCE_HIERARCHICAL``, ``auto``) turns it on when some node
            holds more than one rank of the default process group and every node as many; True
            forces it where it can run (else a warning says why not); False keeps every rank a
            worker of its own. Sparse COO gradients take the hierarchy too, by rows (rail ``i``
            reduces the rows ``r`` with ``r mod L = i``).

    Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are reduced
    through omnireduce whatever the process group's backend (NCCL has none for them): one block per
    touched row, known from the gradient's indices, nothing of the table's size read or allocated
    (:mod:`omnireduce.worker.sparse`); ``stats()["buckets_coo"]`` counts them.

    Fields (declared once, below; see :mod:`omnireduce.hook_state`): the knobs above
    (``process_group``, ``worker_options`` holding ``aggregators``, ``block_size``, ``timeout``,
    ``token``, ``threshold``, ``lanes`` and ``slots``, then ``job``, ``dense_fallback``,
    ``dense_threshold``, ``align_blocks``); the binding (``rank``, ``world_size``, ``worker``,
    ``colocated``, the aggregators agreed on); the decisions (each bucket's union density, the sparse
    COO buckets waiting); the counters (``iteration``, what :meth:`stats` reports).

    Attributes:
        iteration: completed iterations (the hook counts the last bucket of each).
        rank, world_size, job: this rank, the world size and the job name (None until bound).
        worker: the :class:`omnireduce.Worker` (None until bound).
        colocated: the job's :class:`omnireduce.colocate.Colocated` aggregators when it runs its
            own (None otherwise, or until bound).

    The state can be pickled (e.g. inside a checkpoint, or by a launcher that spawns processes);
    its sockets, aggregator processes, token and process group are not. An unpickled state binds
    again on first use, in the default process group (starting colocated aggregators again if it
    was given no addresses).
    """

    # -- knobs: what the user sets (the Args above) ------------------------------------------------
    process_group: dist.ProcessGroup | None = field(default=None, metadata=_meta(KNOB, pickled=False))
    worker_options: dict[str, Any] = field(default_factory=dict, metadata=_meta(KNOB, pickle_as=_without_token))
    job: str | None = field(default=None, metadata=_meta(KNOB))  # (None: resolved when binding)
    path: str = field(default="measure", metadata=_meta(KNOB))  # (resolved: never None)
    dense_fallback: bool = field(default=True, metadata=_meta(KNOB))
    dense_threshold: float = field(default=0.6, metadata=_meta(KNOB))
    measure_trials: int = field(default=3, metadata=_meta(KNOB))
    remeasure_every: int | None = field(default=None, metadata=_meta(KNOB))  # (None: 2% of the iterations)
    align_blocks: bool = field(default=True, metadata=_meta(KNOB))
    hierarchical: bool | None = field(default=None, metadata=_meta(KNOB))  # (None: $OMNIREDUCE_HIERARCHICAL)
    engine: str = field(default="auto", metadata=_meta(KNOB))
    # -- binding: resolved or opened when the state binds to the job; never pickled -----------------
    rank: int | None = field(default=None, metadata=_meta(BINDING))
    world_size: int | None = field(default=None, metadata=_meta(BINDING))
    worker: Worker | None = field(default=None, metadata=_meta(BINDING))  # (or the one given as a knob)
    _owns_worker: bool = field(default=True, metadata=_meta(BINDING))  # (False: given, the state does not close it)
    colocated: Colocated | None = field(default=None, metadata=_meta(BINDING))
    _engine: CollectiveEngine | None = field(default=None, metadata=_meta(BINDING))  # (None: the aggregators)
    # the ways through omnireduce a bucket may take (the path choice measures them with the dense all-reduce)
    _sparse_paths: tuple[str, ...] = field(default=(OMNIREDUCE,), metadata=_meta(BINDING))
    _hierarchy: HierarchicalPath | None = field(default=None, metadata=_meta(BINDING))  # (None: flat)
    _agreement: Agreement = field(default_factory=Agreement, metadata=_meta(BINDING))  # aggregators in use
    _bound: bool = field(default=False, metadata=_meta(BINDING))
    _closed: bool = field(default=False, metadata=_meta(BINDING))
    _bind_error: BaseException | None = field(default=None, metadata=_meta(BINDING))  # (a failed bind stays so)
    _bind_lock: threading.RLock = field(default_factory=threading.RLock, metadata=_meta(BINDING))
    # -- decisions: what steers each bucket's path -------------------------------------------------
    _decisions: BucketDecisions = field(default_factory=BucketDecisions, metadata=_meta(DECISION))
    # (not pickled: timings are of this process's run; restored, buckets are measured again)
    _paths: PathChoice = field(default_factory=PathChoice, metadata=_meta(DECISION, pickled=False))
    _pending_coo: CooBatch = field(default_factory=CooBatch, metadata=_meta(DECISION, pickled=False))
    # -- counters ---------------------------------------------------------------------------------
    iteration: int = field(default=0, metadata=_meta(COUNTER))
    _counters: HookCounters = field(default_factory=HookCounters, metadata=_meta(COUNTER))
    _warned: set[str] = field(default_factory=set, metadata=_meta(COUNTER))  # warn_once's keys

    def __init__(self, process_group: dist.ProcessGroup | None = None, aggregators: str | list[str] | None = None,
                 *, job: str | None = None, block_size: int | None = None, timeout: float | None = None,
                 token: str | None = None, threshold: float = 0.0, dense_fallback: bool = True,
                 dense_threshold: float | None = None, lanes: int | None = None, slots: int | None = None,
                 worker: Worker | None = None, align_blocks: bool = True, hierarchical: bool | None = None,
                 path: str | None = None, measure_trials: int = 3, remeasure_every: int | None = None,
                 engine: str = "auto") -> None:
        if dense_threshold is not None and not 0.0 < dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must be in (0, 1], got {dense_threshold}")
        if path is None:
            path = "omnireduce" if not dense_fallback else "threshold" if dense_threshold is not None else "measure"
        if path not in MODES:
            raise ValueError(f"path must be one of {', '.join(map(repr, MODES))}, got {path!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
        if not dense_fallback and path != OMNIREDUCE:
            raise ValueError(f"dense_fallback=False sends every bucket through omnireduce, which contradicts "
                             f"path={path!r}")
        self._set_fields({})  # every field its declared default
        self.path, self.engine = path, engine
        self.measure_trials, self.remeasure_every = measure_trials, remeasure_every
        self._paths = self._path_choice()
        self.process_group = process_group
        self.job = job or None
        self.worker_options = {"aggregators": aggregators, "block_size": block_size, "timeout": timeout,
                               "token": token, "threshold": threshold, "lanes": lanes, "slots": slots}
        self.dense_fallback = dense_fallback
        self.dense_threshold = 0.6 if dense_threshold is None else dense_threshold
        self.align_blocks = align_blocks
        self.hierarchical = hierarchical
        self.worker = worker
        self._owns_worker = worker is None
        if dist.is_available() and dist.is_initialized():
            self.bind()

    # -- binding to the job --------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        """Whether the state has bound to the job (process group, rank, job name, worker)."""
        return self._bound

    def bind(self) -> None:
        """Bind to the job now, if not yet bound: resolve the process group, rank, world size and
        job name, start or find the aggregators, and connect the worker.

        Collective over the process group: every rank calls it, in the same order (the hook calls
        it on its first call; the constructor, when torch.distributed is initialised). If it fails,
        the state stays failed: later calls raise the same error at once, without any collective
        (so ranks never wait for each other's retries)."""
        with self._bind_lock:
            if self._bound:
                return
            if self._closed:
                raise OmniReduceError("this OmniReduceState is closed")
            if self._bind_error is not None:
                raise OmniReduceError(f"omnireduce could not start: {self._bind_error}") from self._bind_error
            try:
                self._bind()
            except BaseException as e:
                self._bind_error = e
                raise

    def _bind(self) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("omnireduce_hook needs torch.distributed to be initialised (dist.init_process_group) "
                               "before its first call")
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if not self.job:
            self.job = job_name(group)
        if self.worker is None:
            self.worker = connect(self, group)
            self._owns_worker = True
        atexit.register(_release_at_exit, weakref.ref(self._agreement))
        self._sparse_paths = sparse_paths(self.engine, self.path, str(dist.get_backend(group)))
        self._paths = self._path_choice()
        setting = self.hierarchical if self.hierarchical is not None else env_hierarchical()
        self._hierarchy = bind_hierarchy(self, group, setting)
        if self.engine == "collective" or (COLLECTIVE in self._sparse_paths and self._hierarchy is None):
            cfg = self.worker.config
            self._engine = CollectiveEngine.for_group(group, cfg.timeout, cfg.block_size, cfg.lanes, cfg.slots,
                                                      cfg.threshold)
        self._bound = True

    def close(self, *, drain: bool = True) -> None:
        """Leave the job (the worker says goodbye) and stop the colocated aggregators this process
        started, once the other ranks' workers have left them too (``drain``; at most a few seconds).
        Idempotent; runs at interpreter exit for a state with colocated aggregators (without the
        wait when the script ends with an exception). A worker passed in as ``worker=`` is left
        open."""
        with self._bind_lock:
            self._closed = True
            worker, colocated, hierarchy, engine = self.worker, self.colocated, self._hierarchy, self._engine
            self.colocated = self._hierarchy = self._engine = None
            if hierarchy is not None:
                hierarchy.close()
            if engine is not None:
                engine.close()
            if worker is not None and self._owns_worker:
                worker.close()
            if colocated is not None:
                colocated.close(drain=drain)

    # -- the collective dense/sparse decision ----------------------------------------------------

    def _path_choice(self) -> PathChoice:
        return PathChoice(trials=self.measure_trials, remeasure_every=self.remeasure_every,
                          density_of=self._decisions.density_of, paths=(*self._sparse_paths, DENSE))

    def choose(self, key: BucketKey, buffer: Any, iteration: int) -> tuple[str | None, Trial | None]:
        """The path of the dense bucket ``key`` at this call (``"omnireduce"``: the aggregators,
        ``"collective"``: the collective engine, or ``"dense"``; the same on every rank), and the
        trial to time it by when it is being measured (see ``path``).
        Collective when the threshold rule probes a bucket seen for the first time.

        Hierarchical, the path is the way the bucket's shards cross the nodes: with ``"threshold"``
        None (each rail decides on its step thread from its own shard's union density); with
        ``"measure"`` the whole bucket is timed and agreed as on the flat path, but without the
        drift rule (the rails' shards differ in density, and what starts a measurement must be the
        same on every rank: only the periodic re-measurement runs), and a bucket waiting for its
        first decision follows its rail's threshold rule."""
        sparse = self._sparse_paths[0]  # the way through omnireduce where no measurement picks one
        if self.path in (OMNIREDUCE, DENSE):
            return (sparse if self.path == OMNIREDUCE else DENSE), None
        hierarchy = self._hierarchy
        if self.path == "threshold":
            if hierarchy is not None:
                return None, None
            return (DENSE if self.use_dense(key) or probe_dense(self, buffer, key) else sparse), None
        decisions = self._decisions if hierarchy is None else hierarchy.decisions
        density = self._decisions.density_of(key) if hierarchy is None else None
        return self._paths.choose(key, iteration, buffer, density,
                                  lambda: DENSE if decisions.reaches(key, self.dense_threshold) else sparse)

    def use_dense(self, key: BucketKey) -> bool:
        """Whether the bucket ``key`` = (index, numel) goes through the dense all-reduce this time.

        Decided from the bucket's last union density, which is identical on every rank. It is read
        from host memory: a density counted on a CUDA device was copied there when it was counted
        (:class:`omnireduce.hook_decisions.DeviceDensity`), an iteration ago, so deciding does not
        wait for the device."""
        return self.dense_fallback and self._decisions.reaches(key, self.dense_threshold)

    def first_sight(self, key: BucketKey) -> bool:
        """True the first time bucket ``key`` is asked about (it has no density yet), then False."""
        return self._decisions.first_sight(key)

    def record(self, key: BucketKey, density: float | DeviceDensity | None, dense: bool, sent: int,
               received: int, nbytes: int, *, coo: bool = False) -> None:
        """Count a reduced bucket; ``density`` None: not measured (it does not steer the decision);
        ``coo``: a sparse COO gradient."""
        if density is not None:
            self._decisions.remember(key, density)
        path = "buckets_dense" if dense else "buckets_sparse"
        self._counters.add(**{path: 1}, buckets_coo=int(coo), bytes_sent=sent, bytes_received=received,
                           dense_equivalent_bytes=ring_bytes(nbytes, self.world_size))

    # -- reporting -----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """What the hook has done since the state was made.

        ``bytes_sent`` / ``bytes_received``: this rank's bytes for all buckets (dense-fallback
        buckets counted at the ring all-reduce's ``2 (W-1)/W`` times the bucket size);
        ``dense_equivalent_bytes``: what a ring all-reduce of every bucket would have sent;
        ``sent_fraction``: their ratio; ``buckets_sparse`` / ``buckets_dense`` / ``buckets_failed``;
        ``buckets_coo``: those of ``buckets_sparse`` that were sparse COO gradients;
        ``buckets_probed``: buckets seen for the first time whose ranks' largest density was
        all-reduced to pick their path (see ``dense_fallback``);
        ``density``: the last union density of each bucket, keyed by bucket index;
        ``aggregators_in_use``: the addresses a bucket reduced now would use (an aggregator found lost
        leaves it, and comes back once every rank reaches it again: :mod:`omnireduce.membership`);
        ``path``: how buckets pick their path (the knob); ``paths``: per bucket index, with
        ``path="measure"``: the path agreed (``path``, None before the first decision), ``phase``
        (``measuring``, ``awaiting`` the ranks' agreement, ``decided``), the agreed times of each
        path measured (``omnireduce_ms``, ``collective_ms`` where the collective engine was one,
        ``dense_ms``: the slowest rank's medians; None until decided), the iteration the decision
        applies from (``decided_at``), the ``measurements`` made, the bucket's ``numel``, and
        ``vetoed_by_step_check`` (timed faster through omnireduce, dense because whole steps were
        faster so); ``step_checks``: each whole-step check of a plan (``at``: the iteration it
        concluded, ``buckets``, the agreed step medians ``plan_ms`` and ``dense_ms``, ``kept``);
        ``iterations_measuring``: iterations in which some bucket or a step check was being measured;
        ``engine``: who sums the buckets that take omnireduce (``aggregators``, ``collective``, or
        ``measured``: both engines among the paths timed, each bucket's ``path`` says which),
        ``collective_reductions``: the buckets the collective engine reduced;
        ``hierarchical``: whether dense buckets take the hierarchy; ``bytes_in_node``: what this rank
        sent inside its node for them (0 when flat); ``bytes_across_nodes``: what it sent towards
        aggregators and other ranks (``bytes_sent``: with the hierarchy, its rail's reductions and
        the sparse COO buckets; flat, everything); ``rail_collective_reductions``: the rail shards
        the collective engine reduced; ``rail_density``: the
        last union density of each bucket's shard on this rank's rail (hierarchical only).
        """
        out: dict[str, Any] = self._counters.snapshot()
        out["density"] = self._decisions.latest()
        out["iteration"] = self.iteration
        out["path"] = self.path
        engine = self._engine
        out["engine"] = {(OMNIREDUCE,): "aggregators", (COLLECTIVE,): "collective"}.get(self._sparse_paths, "measured")
        out["collective_reductions"] = engine.stats()["reductions"] if engine is not None else 0
        out["paths"] = self._paths.stats()
        out["iterations_measuring"] = self._paths.iterations_measuring
        out["step_checks"] = self._paths.check_stats()
        worker = self.worker
        out["aggregators_in_use"] = worker.aggregators_in_use() if worker is not None else []
        hierarchy = self._hierarchy
        out["hierarchical"] = hierarchy is not None
        flat = {"bytes_in_node": 0, "rail_collective_reductions": 0}
        out.update(hierarchy.stats() if hierarchy is not None else flat)
        out["bytes_across_nodes"] = out["bytes_sent"]
        dense = out["dense_equivalent_bytes"]
        out["sent_fraction"] = out["bytes_sent"] / dense if dense else 0.0
        return out

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    # -- pickling: derived from the field declarations -------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        saved = {}
        for f in dataclasses.fields(self):
            if f.metadata["pickled"]:
                value, pickle_as = getattr(self, f.name), f.metadata["pickle_as"]
                saved[f.name] = pickle_as(value) if pickle_as is not None else value
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self._set_fields(saved)
        self._paths = self._path_choice()

    def _set_fields(self, saved: dict[str, Any]) -> None:
        """Every declared field from ``saved``, or its declared default when absent."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, saved[f.name] if f.name in saved else _default(f))
