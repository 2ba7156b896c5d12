"""The omnireduce hook in the training frameworks most DDP users train with.

The state binds late (:class:`~omnireduce.ddp.OmniReduceState` can be made before
``torch.distributed`` is initialised), so it goes where each framework takes a DDP communication
hook::

    # Hugging Face Accelerate
    model = accelerator.prepare(model)                   # DistributedDataParallel
    model.register_comm_hook(OmniReduceState(), omnireduce_hook)

    # PyTorch Lightning, on GPUs
    trainer = L.Trainer(strategy=DDPStrategy(ddp_comm_state=OmniReduceState(), ddp_comm_hook=omnireduce_hook))

    # PyTorch Lightning, on any device
    trainer = L.Trainer(strategy=OmniReduceDDPStrategy())

Lightning's ``DDPStrategy`` registers a communication hook only when the model is on a CUDA device
(on CPU it ignores ``ddp_comm_hook`` without a word). :class:`OmniReduceDDPStrategy` is a
``DDPStrategy`` that registers it on any device (``OmniReduceState()`` and ``omnireduce_hook`` by
default; every ``DDPStrategy`` argument is taken). It comes from ``lightning.pytorch`` (else
``pytorch_lightning``), imported when the name is first used.

The Hugging Face Transformers ``Trainer`` wraps the model in DDP inside ``train()``, after the user's
last chance to touch it, and hands callbacks the unwrapped model. :func:`use_omnireduce` adds an
:class:`OmniReduceCallback` that holds the trainer and, at ``on_train_begin`` (after
``accelerator.prepare`` has wrapped the model, before the first step), registers the hook on the
trainer's DDP wrapper (``trainer.model_wrapped``, else the one the trainer's accelerator
prepared)::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    state = use_omnireduce(trainer)          # the OmniReduceState, for state.stats()
    trainer.train()

With no aggregator addresses configured, the job starts its own (one per node), as everywhere.
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

__all__ = ["OmniReduceCallback", "OmniReduceDDPStrategy", "find_ddp", "use_omnireduce"]  # noqa: F822 (module __getattr__)

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


class OmniReduceCallback(_CallbackBase):  # type: ignore[misc,valid-type]
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


def _lightning_strategy() -> type:
    """Build :class:`OmniReduceDDPStrategy` on Lightning's ``DDPStrategy`` (imported now)."""
    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError:
        from pytorch_lightning.strategies import DDPStrategy  # the standalone package

    class OmniReduceDDPStrategy(DDPStrategy):  # type: ignore[misc,valid-type]
        """Lightning's ``DDPStrategy`` with the omnireduce hook, registered on any device.

        ``OmniReduceDDPStrategy(*args, ddp_comm_state=None, ddp_comm_hook=None, **kwargs)``: the
        state defaults to a new :class:`~omnireduce.ddp.OmniReduceState`, the hook to
        :func:`~omnireduce.ddp.omnireduce_hook`; everything else is ``DDPStrategy``'s.
        """

        def __init__(self, *args: Any, ddp_comm_state: Any = None, ddp_comm_hook: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, ddp_comm_state=OmniReduceState() if ddp_comm_state is None else ddp_comm_state,
                             ddp_comm_hook=ddp_comm_hook or omnireduce_hook, **kwargs)

        @property
        def omnireduce_state(self) -> Any:
            """The hook's state (``stats()``)."""
            return self._ddp_comm_state

        def configure_ddp(self) -> None:
            super().configure_ddp()  # wraps the model; registers the hook itself on CUDA only
            if self.root_device.type != "cuda":
                hook = self._ddp_comm_hook
                if self._ddp_comm_wrapper is not None:
                    hook = self._ddp_comm_wrapper(hook)
                self.model.register_comm_hook(self._ddp_comm_state, hook)

    OmniReduceDDPStrategy.__module__ = __name__  # pickled by name (the spawn launcher pickles the strategy)
    OmniReduceDDPStrategy.__qualname__ = "OmniReduceDDPStrategy"
    return OmniReduceDDPStrategy


def __getattr__(name: str) -> Any:
    if name == "OmniReduceDDPStrategy":  # Lightning is imported only when this is used
        cls = _lightning_strategy()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
