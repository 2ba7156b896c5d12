"""omnireduce: sparse all-reduce for distributed deep learning.

Workers cut each tensor into blocks and send only the non-zero blocks to aggregator processes,
which sum them and tell every worker which block to send next. See docs/reference/protocol.md.

    agg = omnireduce.Aggregator().start()
    w = omnireduce.Worker(aggregators=[agg.address], rank=0, world_size=1)
    w.allreduce(x)   # x: numpy array or torch tensor, summed over all ranks in place

The two sides are imported lazily, on first use of ``omnireduce.Aggregator`` or
``omnireduce.Worker``: importing the package (or ``omnireduce.aggregator``, which imports it first)
loads neither, so an aggregator process never loads the worker, nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from omnireduce.errors import (
    OmniReduceError,
    OmniReduceMismatchError,
    OmniReduceRefused,
    OmniReduceTimeout,
    WireError,
)
from omnireduce.version import __version__

if TYPE_CHECKING:
    from omnireduce.aggregator import Aggregator, AggregatorLimits
    from omnireduce.worker import Worker

__all__ = [
    "Aggregator",
    "AggregatorLimits",
    "OmniReduceError",
    "OmniReduceMismatchError",
    "OmniReduceRefused",
    "OmniReduceTimeout",
    "WireError",
    "Worker",
    "__version__",
]

_LAZY = {"Aggregator": "omnireduce.aggregator", "AggregatorLimits": "omnireduce.aggregator",
         "Worker": "omnireduce.worker"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omnireduce' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
