"""The futures the hook hands to DDP: CUDA-aware where the bucket is on a GPU, failed with a named error.

A path completes its bucket's future on the thread that finished the reduction. On CUDA the future
is CUDA-aware (:func:`hook_future`): completed under the stream that wrote the result, it records an
event there, and DDP's stream waits for that event, not the host. A failure completes the future
with the error the recorder makes of it (:meth:`omnireduce.ddp.recorder.Recorder.failure`: the
iteration, the bucket and the cause), which DDP raises from ``backward()``: the hook never raises.
"""

from __future__ import annotations

from typing import Any

import torch

from omnireduce.ddp.recorder import Recorder


def hook_future(buffer: torch.Tensor) -> torch.futures.Future[Any]:
    """A CUDA-aware future for ``buffer``'s device (a plain one on the host)."""
    return torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)


def fail(recorder: Recorder, fut: torch.futures.Future[Any], cause: BaseException, iteration: int,
         index: int) -> None:
    """Complete ``fut`` with the recorder's error for its bucket (if it is not complete yet)."""
    err = recorder.failure(cause, iteration, index)
    if not fut.done():
        fut.set_exception(err)


def failed(recorder: Recorder, cause: BaseException, iteration: int, index: int) -> torch.futures.Future[Any]:
    """A future that has already failed with the recorder's error for the bucket."""
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fail(recorder, fut, cause, iteration, index)
    return fut
