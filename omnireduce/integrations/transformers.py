"""The omnireduce hook in the Hugging Face Transformers ``Trainer``.

The ``Trainer`` wraps the model in DDP inside ``train()``, after the user's last chance to touch it,
and hands callbacks the unwrapped model. :func:`use_omnireduce` adds an :class:`OmniReduceCallback`
that holds the trainer and, at ``on_train_begin`` (after ``accelerator.prepare`` has wrapped the
model, before the first step), registers the hook on the trainer's DDP wrapper
(``trainer.model_wrapped``, else the one the trainer's accelerator prepared)::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    state = use_omnireduce(trainer)          # the OmniReduceState, for state.stats()
    trainer.train()
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from omnireduce.ddp import OmniReduceState, omnireduce_hook

try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # transformers is optional: the callback is only useful with it
    _CallbackBase = object  # type: ignore[assignment,misc]

__all__ = ["OmniReduceCallback", "find_ddp", "use_omnireduce"]

log = logging.getLogger("omnireduce.integrations")


def find_ddp(trainer: Any) -> Any:
    """The ``DistributedDataParallel`` wrapper of a Transformers trainer's model, or None.

    Looks at ``trainer.model_wrapped`` (the outermost wrapper once ``train()`` has prepared the
    model), then at the models the trainer's accelerator prepared; a ``torch.compile`` wrapper is
    looked through."""
    from torch.nn.parallel import DistributedDataParallel

    candidates = [getattr(trainer, "model_wrapped", None)]
    accelerator = getattr(trainer, "accelerator", None)
    candidates += list(getattr(accelerator, "_models", None) or [])
    for model in candidates:
        model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
        if isinstance(model, DistributedDataParallel):
            return model
    return None


class OmniReduceCallback(_CallbackBase):
    """A Transformers ``TrainerCallback`` that reduces the trainer's gradients through omnireduce.

    ``OmniReduceCallback(trainer, state=None, hook=omnireduce_hook)``, then
    ``trainer.add_callback(callback)`` (:func:`use_omnireduce` does both). At ``on_train_begin``
    it registers ``hook`` with ``state`` (a new :class:`~omnireduce.ddp.OmniReduceState` by
    default) on the trainer's DDP wrapper, once per wrapper (a second ``train()`` reuses it). If
    the trainer does not train through DDP (one process, FSDP, DeepSpeed), it logs a warning and
    changes nothing.
    """

    def __init__(self, trainer: Any, state: OmniReduceState | None = None, hook: Any = omnireduce_hook) -> None:
        if _CallbackBase is object:
            raise ImportError("OmniReduceCallback needs Hugging Face transformers: pip install transformers")
        self.trainer = trainer
        self.state = state if state is not None else OmniReduceState()
        self.hook = hook
        self._registered: weakref.WeakSet[Any] = weakref.WeakSet()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ddp = find_ddp(self.trainer)
        if ddp is None:
            log.warning("omnireduce: the trainer's model is not wrapped in DistributedDataParallel (one process, "
                        "FSDP or DeepSpeed?): gradients are reduced as the trainer does by default")
            return
        if ddp not in self._registered:
            ddp.register_comm_hook(self.state, self.hook)
            self._registered.add(ddp)


def use_omnireduce(trainer: Any, state: OmniReduceState | None = None, hook: Any = omnireduce_hook) -> OmniReduceState:
    """Make a Transformers ``Trainer`` reduce gradients through omnireduce; returns the hook's state.

    Call it on every rank after making the trainer and before ``trainer.train()``."""
    callback = OmniReduceCallback(trainer, state, hook)
    trainer.add_callback(callback)
    return callback.state
