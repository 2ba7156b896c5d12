"""``all_reduce`` and ``all_reduce_coalesced``: torch.distributed's signatures and semantics, omnireduce's
sparse reduction underneath.

:func:`all_reduce` takes ``torch.distributed.all_reduce``'s arguments and keeps its promises: the
tensor is reduced in place (a sparse COO tensor is replaced by the coalesced sum, as torch's Gloo
all-reduce leaves it), ``async_op=True`` returns a ``Work`` (:class:`~omnireduce.distributed.handle.Handle`)
and otherwise the call returns None once the tensor holds the result, and after the call the tensor
holds the same values on every rank. What omnireduce does not take (:mod:`omnireduce.distributed.takes`)
goes to ``torch.distributed.all_reduce`` with the same arguments.

Sums. float32 blocks are added in float32; float16 and bfloat16 ones too, and rounded once to the
dtype (torch's Gloo adds those in their own precision, each addition rounded). Which order: with the
collective engine, a block non-zero on some rank is summed either in rank order, from -0.0, or, where
the engine hands the union's blocks to the backend's own all-reduce, in that all-reduce's order (Gloo's
ring, NCCL's ring or tree), as torch's call sums; ``OMNIREDUCE_SUM_ORDER=rank`` keeps rank order
always, and the aggregators always sum in rank order. The result is the same bits on every run. AVG
multiplies the sum by ``float32(1/W)``, rounded once. A block that is zero on every rank is not sent:
its elements keep each rank's own zeros (``-0.0`` stays ``-0.0`` where a rank had it; torch's sum of
``-0.0`` and ``0.0`` is ``0.0``: equal as numbers, not as bits). NaN and Inf count as non-zero.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.distributed import call, groups, takes
from omnireduce.distributed.handle import Handle

log = logging.getLogger("omnireduce.distributed")
# torch's own calls, as they were at import: what omnireduce does not take goes there, even where a program
# has since put these functions in torch.distributed's place
_torch_all_reduce = dist.all_reduce
_torch_all_reduce_coalesced = dist.all_reduce_coalesced


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> dist.Work | None:
    """Reduce ``tensor`` over ``group`` (None: the default group) in place, as
    ``torch.distributed.all_reduce`` does (see the module).

    Args:
        tensor: input and output. float32, float16 or bfloat16, strided or sparse COO ``(rows, dim)``,
            with op SUM or AVG, go through omnireduce; anything else through torch.distributed.
        op: a ``torch.distributed.ReduceOp``.
        group: a process group (the default group, a ``new_group``, a ``DeviceMesh`` dimension's
            ``mesh.get_group(dim)``). The first call omnireduce takes on a group is collective over
            its ranks, in the same order on every rank, as torch's ``new_group`` is.
        async_op: return a handle instead of waiting.

    Returns:
        With ``async_op``, a ``torch.distributed.Work``: ``wait()``, ``is_completed()``, ``get_future()``
        (its value the list ``[tensor]``); otherwise None, once ``tensor`` holds the result.

    Raises:
        OmniReduceMismatchError: the ranks disagree about the tensor's shape or dtype, or the op
            (every rank raises it; nothing was sent).
        OmniReduceError: the reduction failed (a rank died, or stopped calling, within
            ``OMNIREDUCE_TIMEOUT``). With ``async_op`` these come from ``wait()``.
    """
    why = takes.declined([tensor], op, group)
    if why is not None:
        log.debug("omnireduce.distributed.all_reduce: torch.distributed's all_reduce takes it (%s)", why)
        return _torch_all_reduce(tensor, op=op, group=group, async_op=async_op)
    return _reduce([tensor], op, group, async_op, coalesced=False)


def all_reduce_coalesced(tensors: torch.Tensor | Sequence[torch.Tensor], op: Any = dist.ReduceOp.SUM,
                         group: Any = None, async_op: bool = False) -> Any:
    """Reduce every tensor of ``tensors`` over ``group`` in place, in one reduction of their
    concatenation (as DDP buckets gradients), as ``torch.distributed.all_reduce_coalesced`` does: the
    tensors must share one dtype and device. With ``async_op`` it returns, as torch's does, a
    ``torch.futures.Future`` whose value is the list of the tensors; otherwise None once they hold the
    result. Errors as :func:`all_reduce`'s; what omnireduce does not take (a sparse tensor among them,
    another dtype or op) goes to ``torch.distributed.all_reduce_coalesced``."""
    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    why = takes.declined(items, op, group)
    if why is None and items[0].layout != torch.strided:
        why = "sparse tensors (all_reduce takes them one at a time)"
    if why is not None:
        log.debug("omnireduce.distributed.all_reduce_coalesced: torch.distributed's takes it (%s)", why)
        return _torch_all_reduce_coalesced(tensors, op=op, group=group, async_op=async_op)
    handle = _submit(items, op, group, coalesced=True)
    if async_op:
        return handle.get_future()
    handle.wait()
    return None


def _reduce(tensors: list[torch.Tensor], op: Any, group: Any, async_op: bool, *, coalesced: bool) -> Handle | None:
    handle = _submit(tensors, op, group, coalesced=coalesced)
    if async_op:
        return handle
    handle.wait()
    return None


def _submit(tensors: list[torch.Tensor], op: Any, group: Any, *, coalesced: bool) -> Handle:
    average = bool(takes.average_of(op))
    runtime = groups.runtime_for(group)
    made = runtime.submit(lambda seq: call.make(seq, tensors, average=average, coalesced=coalesced))
    return Handle(made.future, made.name)
