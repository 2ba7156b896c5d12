"""The handle an ``async_op=True`` call returns: a ``torch.distributed.Work``, as torch's own call returns.

:class:`Handle` is a subclass of ``torch.distributed.Work`` with the methods code written against
torch's handle uses: ``wait()`` (returns True once the tensor holds the result; raises the call's
error, an :class:`~omnireduce.errors.OmniReduceError`, if it failed), ``is_completed()``,
``is_success()``, ``exception()``, ``get_future()`` (a ``torch.futures.Future`` whose value is the
list of the call's tensors, as torch's is), ``result()`` (that list) and ``synchronize()``.

On CUDA, ``wait()`` makes the caller's current stream wait for the result on the device, as torch's
NCCL handle does; the host waits until the result is queued (omnireduce reads a few counts on the
host per call). ``wait(timeout)`` raises :class:`~omnireduce.errors.OmniReduceTimeout` if the call is
not complete by then (the call itself goes on; every call also has omnireduce's own deadline).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.errors import OmniReduceTimeout


class Handle(dist.Work):
    """A call of omnireduce.distributed in flight (see the module)."""

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]], what: str = "all_reduce") -> None:
        super().__init__()
        self._future, self._what = future, what
        self._done = threading.Event()
        future.add_done_callback(lambda _f: self._done.set())

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the call is complete (at most ``timeout``, a timedelta or seconds; zero or None: no
        limit of the caller's); raises the call's error if it failed. Returns True."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if seconds and not self._done.wait(seconds):
            raise OmniReduceTimeout(f"omnireduce.distributed.{self._what}: not complete after {seconds:g} s "
                                    "(wait's timeout)")
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> Any:
        """The call's error once it failed, else None."""
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as e:
            return e
        return None

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The call's tensors once they hold the result (waits; raises the call's error)."""
        self.wait()
        return self._future.value()

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        state = "in flight" if not self._future.done() else "failed" if self.exception() else "complete"
        return f"<omnireduce.distributed.Handle of {self._what}: {state}>"
