"""The user's options of an :class:`omnireduce.ddp.OmniReduceState`: typed, validated once, pickled.

The knobs are explained once, in :class:`omnireduce.ddp.OmniReduceState`'s docstring; this module
holds them as a frozen value (:class:`Options`), resolves the older knobs into ``path``, refuses
contradictions with a clear ``ValueError`` at construction, and pickles everything but the token
(a secret never travels in a checkpoint). The options never change after construction: what changes
while training (the runtime, the counters, the decisions) lives elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import TypedDict

from omnireduce.compression import BlockTopK
from omnireduce.engines.ways import ENGINES, Way
from omnireduce.names import StrEnum


class Mode(StrEnum):
    """How each bucket picks its way (the ``path`` knob; see :class:`omnireduce.ddp.OmniReduceState`)."""

    MEASURE = "measure"  # time the ways on the bucket, keep the fastest, check the plan on whole steps
    THRESHOLD = "threshold"  # dense once the bucket's union density reached dense_threshold
    OMNIREDUCE = "omnireduce"  # always through omnireduce (the first of its ways this job has)
    DENSE = "dense"  # always the process group's all-reduce


AUTO, AGGREGATORS = "auto", str(Way.AGGREGATORS)
ENGINE_NAMES = (AUTO, AGGREGATORS, *map(str, ENGINES))  # the ``engine`` knob: "auto", or a way of omnireduce
DEFAULT_DENSE_THRESHOLD = 0.6
SUM_ORDERS = ("any", "rank")  # the ``sum_order`` knob's values (omnireduce.engines.plan.Order)


class WorkerOptions(TypedDict, total=False):
    """The options a :class:`omnireduce.Worker` takes (:meth:`Options.worker_options`: those set only)."""

    aggregators: str | list[str]
    block_size: int
    timeout: float
    token: str
    threshold: float
    lanes: int
    slots: int


@dataclasses.dataclass(frozen=True)
class Options:
    """What the user set (see :class:`omnireduce.ddp.OmniReduceState` for each knob)."""

    aggregators: str | tuple[str, ...] | None = None
    job: str | None = None
    block_size: int | None = None
    timeout: float | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    threshold: float = 0.0
    lanes: int | None = None
    slots: int | None = None
    path: Mode = Mode.MEASURE
    dense_fallback: bool = True
    dense_threshold: float = DEFAULT_DENSE_THRESHOLD
    measure_trials: int = 3
    remeasure_every: int | None = None
    align_blocks: bool = True
    hierarchical: bool | None = None
    engine: str = "auto"
    compression: BlockTopK | None = None
    sum_order: str = "any"

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Mode(self.path))

    @classmethod
    def resolve(cls, *, path: str | None = None, dense_fallback: bool = True, dense_threshold: float | None = None,
                engine: str = "auto", measure_trials: int = 3,
                aggregators: str | list[str] | tuple[str, ...] | None = None, job: str | None = None,
                block_size: int | None = None, timeout: float | None = None, token: str | None = None,
                threshold: float = 0.0, lanes: int | None = None, slots: int | None = None,
                remeasure_every: int | None = None, align_blocks: bool = True, hierarchical: bool | None = None,
                compression: BlockTopK | None = None, sum_order: str = "any") -> Options:
        """The options from the constructor's arguments: ``path`` None resolves from the older knobs
        (``"threshold"`` when ``dense_threshold`` is given, ``"omnireduce"`` when ``dense_fallback`` is
        False, else ``"measure"``); contradictions raise ``ValueError``. The other arguments are the
        fields of the same names, with their defaults."""
        if dense_threshold is not None and not 0.0 < dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must be in (0, 1], got {dense_threshold}")
        if path is None:
            path = Mode.OMNIREDUCE if not dense_fallback else Mode.THRESHOLD if dense_threshold is not None \
                else Mode.MEASURE
        if path not in set(Mode):
            raise ValueError(f"path must be one of {', '.join(repr(m.value) for m in Mode)}, got {path!r}")
        if engine not in ENGINE_NAMES:
            raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINE_NAMES))}, got {engine!r}")
        if not dense_fallback and path != Mode.OMNIREDUCE:
            raise ValueError(f"dense_fallback=False sends every bucket through omnireduce, which contradicts "
                             f"path={path!r}")
        if measure_trials < 1:
            raise ValueError(f"path choice: trials >= 1 expected, got measure_trials={measure_trials}")
        if (remeasure_every or 0) < 0:
            raise ValueError(f"path choice: remeasure_every >= 0 expected, got {remeasure_every}")
        if sum_order not in SUM_ORDERS:
            raise ValueError(f"sum_order must be one of {', '.join(map(repr, SUM_ORDERS))}, got {sum_order!r}")
        if compression is not None and not isinstance(compression, BlockTopK):
            raise ValueError(f"compression must be an omnireduce.compression.BlockTopK or None, got "
                             f"{type(compression).__name__}")
        if isinstance(aggregators, list):
            aggregators = tuple(aggregators)
        dense = DEFAULT_DENSE_THRESHOLD if dense_threshold is None else dense_threshold
        return cls(path=Mode(path), dense_fallback=dense_fallback, dense_threshold=dense, engine=engine,
                   measure_trials=measure_trials, aggregators=aggregators, job=job, block_size=block_size,
                   timeout=timeout, token=token, threshold=threshold, lanes=lanes, slots=slots,
                   remeasure_every=remeasure_every, align_blocks=align_blocks, hierarchical=hierarchical,
                   compression=compression, sum_order=sum_order)

    def worker_options(self) -> WorkerOptions:
        """The options a :class:`omnireduce.Worker` takes, those set only."""
        given: WorkerOptions = {}
        if self.aggregators is not None:
            given["aggregators"] = list(self.aggregators) if isinstance(self.aggregators, tuple) else self.aggregators
        if self.block_size is not None:
            given["block_size"] = self.block_size
        if self.timeout is not None:
            given["timeout"] = self.timeout
        if self.token is not None:
            given["token"] = self.token
        if self.threshold is not None:
            given["threshold"] = self.threshold
        if self.lanes is not None:
            given["lanes"] = self.lanes
        if self.slots is not None:
            given["slots"] = self.slots
        return given

    def __getstate__(self) -> dict[str, object]:
        saved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        saved["token"] = None  # a secret never travels in a pickle
        return saved

    def __setstate__(self, saved: dict[str, object]) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, saved.get(f.name, f.default))
        object.__setattr__(self, "path", Mode(self.path))  # (older pickles hold the name)


def engine_name(ways: tuple[Way, ...]) -> str:
    """How ``stats()`` names the engine of a job whose buckets may take ``ways`` (through omnireduce):
    ``"aggregators"``, an engine's way (``"collective"``), or ``"measured"`` (several, timed)."""
    if len(ways) > 1:
        return "measured"
    return str(ways[0])
