"""One state serves one DDP model: the check that catches a state registered on a second model.

Registering one :class:`~omnireduce.ddp.OmniReduceState` on two DDP models (an easy mistake with
TorchRec, whose ``DistributedModelParallel`` holds several DDPs) would mix their bookkeeping: the
iteration counted twice per step, two models' bucket 0 sharing one path decision. DDP hands a
model's buckets to the hook in index order, 0 to the last, and every bucket holds parameters of
that model only; so the guard learns the model's parameters over its first complete iteration and
then refuses a bucket whose first parameter is not among them, or (during that first iteration)
a bucket 0 of other parameters while another bucket 0's iteration is under way. A repeated bucket 0
of the same parameters is an iteration started again after one that failed midway: accepted.
"""

from __future__ import annotations

from typing import Any

from omnireduce.errors import OmniReduceError


class SecondModelError(OmniReduceError, ValueError):
    """An :class:`~omnireduce.ddp.OmniReduceState` was registered on a second DDP model."""


class ModelGuard:
    """The one-model check of one state (see the module); :meth:`check` at every bucket."""

    def __init__(self) -> None:
        self._params: set[int] | None = None  # the model's parameters, once one iteration completed
        self._collecting: set[int] = set()
        self._expected = 0  # the next bucket index of the iteration under way
        self._first: int | None = None  # the first parameter of this iteration's bucket 0

    def check(self, grad_bucket: Any) -> None:
        """Raise :class:`SecondModelError` if ``grad_bucket`` belongs to another DDP model."""
        index, params = grad_bucket.index(), grad_bucket.parameters()
        first = id(params[0]) if params else None
        if self._params is not None and first is not None and first not in self._params:
            raise _error(index)
        restarted = index == 0 and (self._first is None or first == self._first)  # (a failed iteration's)
        if index != self._expected and not restarted:
            raise _error(index)
        if index == 0:
            self._first = first
        if self._params is None:
            self._collecting.update(id(p) for p in params)
        self._expected = index + 1
        if grad_bucket.is_last():
            self._expected, self._first = 0, None
            if self._params is None:
                self._params, self._collecting = self._collecting, set()


def _error(index: int) -> SecondModelError:
    return SecondModelError(
        f"this OmniReduceState already serves another DDP model (bucket {index} holds parameters of a second "
        "model): one state serves one DDP model. Register a state of its own on each model "
        "(ddp.register_comm_hook(OmniReduceState(), omnireduce_hook) per model; state.sibling() shares the "
        "first one's aggregators), or for TorchRec call omnireduce.integrations.use_omnireduce(dmp)")
