"""The user's options of an :class:`omnireduce.ddp.OmniReduceState`: typed, validated once, pickled.

The knobs are explained once, in :class:`omnireduce.ddp.OmniReduceState`'s docstring; this module
holds them as a frozen value (:class:`Options`), resolves the older knobs into ``path``, refuses
contradictions with a clear ``ValueError`` at construction, and pickles everything but the token
(a secret never travels in a checkpoint). The options never change after construction: what changes
while training (the runtime, the counters, the decisions) lives elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnireduce.compression import BlockTopK

MEASURE, THRESHOLD, OMNIREDUCE, COLLECTIVE, DENSE = "measure", "threshold", "omnireduce", "collective", "dense"
UNCOMPRESSED = "uncompressed"  # a compressed bucket's way: whole, with its residual, through the dense all-reduce
PATHS = (MEASURE, THRESHOLD, OMNIREDUCE, DENSE)  # the ``path`` knob's values
ENGINES = ("auto", "aggregators", COLLECTIVE)  # the ``engine`` knob's values
DEFAULT_DENSE_THRESHOLD = 0.6


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
    path: str = MEASURE
    dense_fallback: bool = True
    dense_threshold: float = DEFAULT_DENSE_THRESHOLD
    measure_trials: int = 3
    remeasure_every: int | None = None
    align_blocks: bool = True
    hierarchical: bool | None = None
    engine: str = "auto"
    compression: BlockTopK | None = None

    @classmethod
    def resolve(cls, *, path: str | None = None, dense_fallback: bool = True, dense_threshold: float | None = None,
                engine: str = "auto", measure_trials: int = 3, aggregators: Any = None, **rest: Any) -> Options:
        """The options from the constructor's arguments: ``path`` None resolves from the older knobs
        (``"threshold"`` when ``dense_threshold`` is given, ``"omnireduce"`` when ``dense_fallback`` is
        False, else ``"measure"``); contradictions raise ``ValueError``."""
        if dense_threshold is not None and not 0.0 < dense_threshold <= 1.0:
            raise ValueError(f"dense_threshold must be in (0, 1], got {dense_threshold}")
        if path is None:
            path = OMNIREDUCE if not dense_fallback else THRESHOLD if dense_threshold is not None else MEASURE
        if path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))}, got {path!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(map(repr, ENGINES))}, got {engine!r}")
        if not dense_fallback and path != OMNIREDUCE:
            raise ValueError(f"dense_fallback=False sends every bucket through omnireduce, which contradicts "
                             f"path={path!r}")
        if measure_trials < 1:
            raise ValueError(f"path choice: trials >= 1 expected, got measure_trials={measure_trials}")
        if (rest.get("remeasure_every") or 0) < 0:
            raise ValueError(f"path choice: remeasure_every >= 0 expected, got {rest['remeasure_every']}")
        compression = rest.get("compression")
        if compression is not None and not isinstance(compression, BlockTopK):
            raise ValueError(f"compression must be an omnireduce.compression.BlockTopK or None, got "
                             f"{type(compression).__name__}")
        if compression is not None and compression.selection != "shared":
            raise ValueError(f"OmniReduceState(compression=...) takes selection='shared', got "
                             f"{compression.selection!r} (the stale selection rides on a dense all-reduce: "
                             "compression_hook has it)")
        if isinstance(aggregators, list):
            aggregators = tuple(aggregators)
        threshold = DEFAULT_DENSE_THRESHOLD if dense_threshold is None else dense_threshold
        return cls(path=path, dense_fallback=dense_fallback, dense_threshold=threshold, engine=engine,
                   measure_trials=measure_trials, aggregators=aggregators, **rest)

    def worker_options(self) -> dict[str, Any]:
        """The options a :class:`omnireduce.Worker` takes, those set only."""
        given = {"aggregators": self.aggregators, "block_size": self.block_size, "timeout": self.timeout,
                 "token": self.token, "threshold": self.threshold, "lanes": self.lanes, "slots": self.slots}
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in given.items() if v is not None}

    def __getstate__(self) -> dict[str, Any]:
        saved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        saved["token"] = None  # a secret never travels in a pickle
        return saved

    def __setstate__(self, saved: dict[str, Any]) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, saved.get(f.name, f.default))
