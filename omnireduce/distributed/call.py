"""One call of :func:`omnireduce.distributed.all_reduce` (or of ``all_reduce_coalesced``): what is reduced,
and how the result reaches the caller's tensors.

Made on the caller's thread, where the tensors were produced: a strided tensor is reduced in place
through a view of it (detached: the autograd graph never sees the write, as with torch's own call);
a sparse COO tensor's sum is a new coalesced tensor, copied into the caller's (torch's Gloo
all-reduce of a sparse tensor leaves the same there: the union of the rows present on some rank,
ascending, coalesced); a coalesced call's tensors are copied into one flat buffer, reduced as one
tensor (as DDP buckets gradients) and copied back. On CUDA an event is recorded on the caller's
current stream, which the group's thread waits for on the device before it touches the tensors.

The call's :attr:`Call.future` completes with the list of the caller's tensors once they hold the
result (what ``get_future()`` of torch's ``Work`` gives), or fails with the reason; on CUDA it is
completed on a stream that has the result, so a reader's stream waits for it on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from omnireduce.distributed import header


@dataclasses.dataclass
class Call:
    """A call's tensors (the future's value), its buffer (what the reducer reduces), SUM or AVG, its
    header, its future, and on CUDA the caller's event."""

    tensors: list[torch.Tensor]
    buffer: torch.Tensor
    average: bool
    header: np.ndarray
    future: torch.futures.Future[list[torch.Tensor]]
    ready: Any = None
    flat: bool = False  # the tensors were copied into the buffer: copy the result back
    name: str = "all_reduce"

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def finished(self, reduction: torch.futures.Future[Any]) -> None:
        """The reducer's future is complete: write the result back and complete :attr:`future` (or fail
        it with the reducer's error). Runs on the thread that completed ``reduction``, with a stream
        current that has its result (torch's callbacks of CUDA futures)."""
        try:
            result = reduction.value()
            with torch.no_grad():
                if self.flat:
                    at = 0
                    for t in self.tensors:
                        t.copy_(result[at: at + t.numel()].view_as(t))
                        at += t.numel()
                elif self.tensors[0].layout != torch.strided:
                    self.tensors[0].copy_(result)
        except BaseException as e:
            self.fail(e)
            return
        if not self.future.done():
            self.future.set_result(self.tensors)

    def fail(self, error: BaseException) -> None:
        """Fail the call with ``error`` (unless it is complete already)."""
        if not self.future.done():
            self.future.set_exception(error)  # type: ignore[arg-type]


def make(seq: int, tensors: list[torch.Tensor], *, average: bool, coalesced: bool) -> Call:
    """Call number ``seq`` of its group on ``tensors`` (see the module)."""
    first = tensors[0]
    flat = coalesced and len(tensors) > 1
    buffer = torch.cat([t.detach().reshape(-1) for t in tensors]) if flat else first.detach()
    ready = None
    if first.is_cuda:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(first.device))
    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(
        devices=[first.device] if first.is_cuda else None)
    return Call(list(tensors), buffer, average, header.encode(seq, tensors, average=average, coalesced=coalesced),
                future, ready, flat, "all_reduce_coalesced" if coalesced else "all_reduce")
