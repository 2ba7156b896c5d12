"""The omnireduce hook in the training frameworks most DDP users train with.

The state binds late (:class:`~omnireduce.ddp.OmniReduceState` can be made before
``torch.distributed`` is initialised), so it goes where each framework takes a DDP communication
hook::

    # Hugging Face Accelerate
    model = accelerator.prepare(model)                   # DistributedDataParallel
    model.register_comm_hook(OmniReduceState(), omnireduce_hook)

    # PyTorch Lightning, on any device (omnireduce.integrations.lightning)
    trainer = L.Trainer(strategy=OmniReduceDDPStrategy())

    # Hugging Face Transformers (omnireduce.integrations.transformers)
    state = use_omnireduce(trainer)

With no aggregator addresses configured, the job starts its own (one per node), as everywhere. The
frameworks themselves are imported only when their part is used.
"""

from __future__ import annotations

from typing import Any

from omnireduce.integrations.transformers import OmniReduceCallback, find_ddp, use_omnireduce

__all__ = ["OmniReduceCallback", "OmniReduceDDPStrategy", "find_ddp", "use_omnireduce"]


def __getattr__(name: str) -> Any:
    if name == "OmniReduceDDPStrategy":  # Lightning is imported only when this is used
        from omnireduce.integrations import lightning

        cls = lightning.OmniReduceDDPStrategy
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
