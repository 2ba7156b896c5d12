"""The omnireduce hook in PyTorch Lightning: :class:`OmniReduceDDPStrategy`.

Lightning's ``DDPStrategy`` registers a communication hook only when the model is on a CUDA device
(on CPU it ignores ``ddp_comm_hook`` without a word). ``OmniReduceDDPStrategy`` is a ``DDPStrategy``
that registers it on any device (``OmniReduceState()`` and ``omnireduce_hook`` by default; every
``DDPStrategy`` argument is taken). It comes from ``lightning.pytorch`` (else ``pytorch_lightning``),
imported when the name is first used::

    trainer = L.Trainer(strategy=OmniReduceDDPStrategy())
"""

from __future__ import annotations

from typing import Any, cast

from omnireduce.ddp import OmniReduceState, omnireduce_hook

__all__ = ["OmniReduceDDPStrategy"]  # noqa: F822 (module __getattr__)


def _lightning_strategy() -> type:
    """Build :class:`OmniReduceDDPStrategy` on Lightning's ``DDPStrategy`` (imported now)."""
    from torch.nn.parallel import DistributedDataParallel

    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError:
        from pytorch_lightning.strategies import DDPStrategy  # type: ignore[assignment] # (the standalone package)

    class OmniReduceDDPStrategy(DDPStrategy):
        """Lightning's ``DDPStrategy`` with the omnireduce hook, registered on any device.

        ``OmniReduceDDPStrategy(*args, ddp_comm_state=None, ddp_comm_hook=None, **kwargs)``: the
        state defaults to a new :class:`~omnireduce.ddp.OmniReduceState`, the hook to
        :func:`~omnireduce.ddp.omnireduce_hook`; everything else is ``DDPStrategy``'s.
        """

        def __init__(self, *args: Any, ddp_comm_state: Any = None, ddp_comm_hook: Any = None, **kwargs: Any) -> None:
            kwargs.update(ddp_comm_state=OmniReduceState() if ddp_comm_state is None else ddp_comm_state,
                          ddp_comm_hook=ddp_comm_hook or omnireduce_hook)
            super().__init__(*args, **kwargs)

        @property
        def omnireduce_state(self) -> Any:
            """The hook's state (``stats()``)."""
            return self._ddp_comm_state

        def configure_ddp(self) -> None:
            super().configure_ddp()  # wraps the model; registers the hook itself on CUDA only
            if self.root_device.type != "cuda":
                hook: Any = self._ddp_comm_hook  # (never None: the constructor's default)
                if self._ddp_comm_wrapper is not None:
                    hook = self._ddp_comm_wrapper(hook)
                cast(DistributedDataParallel, self.model).register_comm_hook(self._ddp_comm_state, hook)

    # pickled by name (the spawn launcher pickles the strategy), found through the package's __getattr__
    OmniReduceDDPStrategy.__module__ = "omnireduce.integrations"
    OmniReduceDDPStrategy.__qualname__ = "OmniReduceDDPStrategy"
    return OmniReduceDDPStrategy


def __getattr__(name: str) -> Any:
    if name == "OmniReduceDDPStrategy":  # Lightning is imported only when this is used
        cls = _lightning_strategy()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
