"""Which FSDP hook calls belong to one backward pass: the iteration each reduction is counted in, and
the end of each pass.

The path choice counts iterations and agrees at the end of each one (the DDP hook does both at DDP's
last bucket). FSDP2 says neither: it calls the units' hooks one after another in each backward pass
that syncs gradients (the same units, in the same order, on every rank), some from autograd's
post-backward of the unit's forward inputs, the others (units whose inputs need no gradient: an
embedding fed ids) from the root's callback at the end of backward, which FSDP queues at the start
of backward. So :class:`BackwardPasses` tells the passes apart by autograd's graph task (one per
``backward()``), and at the first call of a pass queues a callback of its own behind FSDP's
(``queue_callback``: autograd runs the final callbacks in the order queued, those queued by a
callback included): it runs once every unit's hook of the pass has returned, and ends the pass
(``ended(iteration, device)``: the runtime's ``after_last_bucket``). A backward pass without
gradient sync (``set_requires_gradient_sync(False)``) calls no hook and counts no iteration.

A backward that fails midway never runs its final callbacks: the next pass then starts a new
iteration without ending the failed one (nothing is agreed for it). A call outside any backward
(none is expected from FSDP2) is a pass of its own, ended by :meth:`BackwardPasses.leave` right
after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch
from torch.autograd import Variable

__all__ = ["BackwardPasses"]

log = logging.getLogger("omnireduce.integrations")

OUTSIDE = -1  # autograd's graph task id outside backward


class BackwardPasses:
    """The backward passes of one :func:`~omnireduce.integrations.fsdp.use_omnireduce` (see the module):
    ``ended(iteration, device)`` is called once per pass, after its last hook call."""

    def __init__(self, ended: Callable[[int, torch.device], None]) -> None:
        self.ended = ended
        self.iteration = 0  # the pass under way, or the next one
        self._task: int | None = None  # the graph task of the pass under way (None: none)
        self._device: torch.device | None = None
        self._lock = threading.Lock()

    def enter(self, tensor: torch.Tensor) -> int:
        """The iteration of a hook call reducing ``tensor``; the first call of a backward pass starts
        it (and queues its end)."""
        task = torch._C._current_graph_task_id()
        with self._lock:
            if self._task is not None and task == self._task and task != OUTSIDE:
                return self.iteration
            if self._task is not None:  # (the last pass's end never ran: its backward failed)
                log.debug("omnireduce: backward pass %d did not end; the next one starts", self.iteration)
                self.iteration += 1
            self._task, self._device = task, tensor.device
            iteration = self.iteration
        if task != OUTSIDE:
            Variable._execution_engine.queue_callback(lambda: self._end(task))
        return iteration

    def leave(self) -> None:
        """After a hook call: end the pass if the call was made outside backward (see the module)."""
        if self._task == OUTSIDE:
            self._end(OUTSIDE)

    def _end(self, task: int) -> None:
        with self._lock:
            if self._task != task:
                return
            iteration, device = self.iteration, self._device
            self._task = None
            self.iteration += 1
        assert device is not None
        try:
            self.ended(iteration, device)
        except Exception as e:  # (a hook's error, if any, is what backward raises; this one is logged)
            log.error("omnireduce: the end of backward pass %d failed: %s", iteration, e)
