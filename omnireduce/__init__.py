"""omnireduce: sparse all-reduce for distributed deep learning.

Workers cut each tensor into blocks and send only the non-zero blocks to aggregator processes,
which sum them and tell every worker which block to send next. See docs/protocol.md.

    agg = omnireduce.Aggregator().start()
    w = omnireduce.Worker(aggregators=[agg.address], rank=0, world_size=1)
    w.allreduce(x)   # x: numpy array or torch tensor, summed over all ranks in place
"""

from omnireduce.aggregator import Aggregator, AggregatorLimits
from omnireduce.errors import (
    OmniReduceError,
    OmniReduceMismatchError,
    OmniReduceRefused,
    OmniReduceTimeout,
    WireError,
)
from omnireduce.worker import Worker

__version__ = "0.1.0"

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
