"""FSDP2's all-reduce hook for one unit: its reduce-scatter output across the replicas, in place.

With a 1-D shard mesh, FSDP2 calls ``hook(reduce_output)`` once per unit and backward (not for
the backwards that ``set_requires_gradient_sync(False)`` skips), on the thread running backward,
right after the reduce-scatter, with its all-reduce stream current (CUDA; on the CPU streams are
nothing), and then, on that stream, divides by its post-divide factor if any, casts to the
parameters' dtype and hands out the gradient shards. The hook returns nothing: the result must be
in ``reduce_output`` when the work queued on that stream runs. So :meth:`ReplicaHook.__call__`
counts the call in its backward pass (:mod:`omnireduce.integrations.fsdp.passes`, shared by every
unit's hook: the pass's end starts the replicas' agreement), asks the reducer
(:mod:`omnireduce.integrations.fsdp.reducer`) and waits for its future:

- on the CPU, until the reduction is done (native HSDP's Gloo all-reduce blocks the same way);
- on CUDA, ``Future.wait()`` blocks the host until the future completes, then makes FSDP's
  stream wait on the device for the stream that wrote the result: for the dense way that is once
  the backend has queued the all-reduce; for the collective engine once its thread has queued the
  reduction's last step on omnireduce's side stream (its one wait for the device, for the blocks'
  counts, is on that thread: the training thread waits for the engine's thread, never on a device
  event itself). Not yet run on a GPU.

Averaging as native HSDP does. FSDP2 applies its factors for the shard group alone with a 1-D
mesh: ReduceOp.AVG over the shard group for fp32 and bf16, or SUM with a pre-divide before and a
post-divide after the hook (fp16, ``set_force_sum_reduction_for_comms``), ``S`` in all; native
HSDP divides by ``S x R`` in all, the replicate group's ``R`` in its all-reduce (AVG) or in the
post-divide. So the hook sums across the replicas and divides by R, except when the user set a
gradient divide factor (``set_gradient_divide_factor``): FSDP then divides by that factor in all
and native HSDP's all-reduce sums, and so does the hook.
"""

from __future__ import annotations

import logging

import torch

from omnireduce.errors import OmniReduceError
from omnireduce.integrations.fsdp.passes import BackwardPasses
from omnireduce.integrations.fsdp.reducer import ReplicaReducer
from omnireduce.integrations.fsdp.units import Unit

__all__ = ["ReplicaHook"]

log = logging.getLogger("omnireduce.integrations")


class ReplicaHook:
    """The hook of ``unit`` (see the module): ``reducer`` reduces, ``passes`` counts the backward
    passes (one for all the units), ``base_block_size`` is the blocks' size where the unit's own
    does not apply (:meth:`Unit.block_size_for`)."""

    def __init__(self, unit: Unit, reducer: ReplicaReducer, passes: BackwardPasses, base_block_size: int) -> None:
        self.unit, self.reducer, self.passes, self.base_block_size = unit, reducer, passes, base_block_size
        self.closed = False
        self._warned = False

    @property
    def where(self) -> str:
        return f"FSDP module {self.unit.name or '(the model)'!r}"

    def __call__(self, output: torch.Tensor) -> None:
        if self.closed:
            raise OmniReduceError(f"omnireduce: {self.where}: its cross-replica reduction was closed "
                                  "(use_omnireduce(...).close()): gradients are no longer reduced across replicas")
        if output.dim() != 1 or not output.is_contiguous():
            raise OmniReduceError(f"omnireduce: {self.where}: expected FSDP2's flat reduce-scatter output, got a "
                                  f"tensor of shape {tuple(output.shape)} (contiguous: {output.is_contiguous()})")
        group = self.unit.group
        if not getattr(group, "all_reduce_grads", True) and not self._warned:
            self._warned = True
            log.warning("omnireduce: %s: set_requires_all_reduce(False) has no effect here: with a 1-D shard mesh "
                        "FSDP2 calls the hook after every reduce-scatter, and omnireduce reduces each one across "
                        "the replicas (correct, but no communication is saved)", self.where)
        average = getattr(group, "gradient_divide_factor", None) is None
        block = self.unit.block_size_for(output.numel(), self.base_block_size)
        iteration = self.passes.enter(output)
        try:
            self.reducer.reduce(output, self.unit.key, iteration=iteration, average=average, block_size=block).wait()
        except Exception as e:
            raise OmniReduceError(f"omnireduce: {self.where}: the reduction across replicas failed (backward pass "
                                  f"{iteration}): {reason(e)}") from e
        finally:
            self.passes.leave()


CALLBACK = "Got the following error when running the callback: "


def reason(e: BaseException) -> str:
    """``e`` as the user should read it: ``type: message``. An exception raised in a future's
    callback reaches the waiter wrapped by torch (``RuntimeError: Got the following error when
    running the callback: <type>: <message>``, then ``At:`` and a stack): the inner part is kept."""
    text = f"{type(e).__name__}: {e}"
    if CALLBACK in text:
        text = text.split(CALLBACK, 1)[1]
    return text.split("\n\nAt:\n", 1)[0].strip()
