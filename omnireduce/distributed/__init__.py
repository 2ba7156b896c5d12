"""``torch.distributed.all_reduce``, sparse: the same call, for any torch.distributed code.

    from omnireduce.distributed import all_reduce      # instead of: from torch.distributed import all_reduce

    all_reduce(tensor)                                 # SUM, in place, on the default group
    work = all_reduce(tensor, op=ReduceOp.AVG, group=g, async_op=True)
    work.wait()

``op`` SUM and AVG on float32, float16 and bfloat16 tensors (strided, or sparse COO of shape
``(rows, dim)``) on a Gloo or NCCL group go through omnireduce: only the blocks non-zero on some rank
travel. Everything else (other ops, other dtypes, other backends, tensor subclasses) is handed to
``torch.distributed.all_reduce`` unchanged, so a program switches by changing one import.

- :mod:`~omnireduce.distributed.api`: :func:`all_reduce` and :func:`all_reduce_coalesced`;
- :mod:`~omnireduce.distributed.takes`: which calls omnireduce takes, and why not the others;
- :mod:`~omnireduce.distributed.groups`: one runtime per process group, built on the group's first
  call (collective), closed by :func:`shutdown` or at exit; :mod:`~omnireduce.distributed.subgroups`
  makes the process group of its own each needs; :mod:`~omnireduce.distributed.reducers` its engine
  (the collective engine, or the aggregators when ``OMNIREDUCE_AGGREGATORS`` names them);
- :mod:`~omnireduce.distributed.runtime`: a group's calls in order on one thread: the ranks' headers
  compared (:mod:`~omnireduce.distributed.header`), then the reduction;
- :mod:`~omnireduce.distributed.call` (one call's tensors and how its result is written back) and
  :mod:`~omnireduce.distributed.handle` (the ``Work`` an ``async_op=True`` call returns).
"""

from __future__ import annotations

from torch.distributed import ReduceOp  # noqa: F401 (torch's, importable from here too; documented there)

from omnireduce import default_group
from omnireduce.distributed.api import all_reduce, all_reduce_coalesced
from omnireduce.distributed.groups import shutdown, stats
from omnireduce.distributed.handle import Handle

default_group.guard()  # (imported before the program's init_process_group: torch's defaults then hold no group)

__all__ = ["Handle", "all_reduce", "all_reduce_coalesced", "shutdown", "stats"]
