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

    # TorchRec: every DDP of a DistributedModelParallel, its DATA_PARALLEL lookups' included
    # (omnireduce.integrations.torchrec)
    reduced = use_omnireduce(dmp)                        # reduced.stats(), reduced.close()

    # FSDP2 as HSDP: a model sharded with fully_shard(..., mesh=mesh["shard"]), reduced across
    # mesh["replicate"] (omnireduce.integrations.fsdp)
    reduced = use_omnireduce(model, mesh=mesh)           # reduced.stats(), reduced.close()

With no aggregator addresses configured, the job starts its own (one per node), as everywhere. The
frameworks themselves are imported only when their part is used.
"""

from __future__ import annotations

from typing import Any

from omnireduce.ddp import OmniReduceState, omnireduce_hook
from omnireduce.integrations import fsdp as _fsdp
from omnireduce.integrations import torchrec as _torchrec
from omnireduce.integrations import transformers as _transformers
from omnireduce.integrations.torchrec import OmniReduceStates, find_ddps
from omnireduce.integrations.transformers import OmniReduceCallback, find_ddp

__all__ = ["OmniReduceCallback", "OmniReduceDDPStrategy", "OmniReduceStates", "find_ddp", "find_ddps",
           "use_omnireduce"]


def use_omnireduce(target: Any, state: OmniReduceState | None = None, hook: Any = omnireduce_hook,
                   **options: Any) -> Any:
    """Reduce a framework's gradients through omnireduce; call it on every rank, before training.

    - a TorchRec ``DistributedModelParallel`` (after ``init_process_group`` and sharding, before the
      first forward): the hook on each of its DDPs, its DATA_PARALLEL lookups' included, one state per
      DDP made from ``options`` (:class:`~omnireduce.ddp.OmniReduceState`'s arguments), all at the
      same aggregators; returns an :class:`OmniReduceStates` (``stats()``, ``close()``);
      :func:`omnireduce.integrations.torchrec.use_omnireduce`.
    - a module sharded with FSDP2's ``fully_shard(..., mesh=mesh["shard"])`` (its FSDP modules, or
      a model holding them), with ``mesh=`` the 2-D ``("replicate", "shard")`` DeviceMesh: each FSDP
      module's reduce-scatter output reduced across ``mesh["replicate"]``, averaged as native HSDP
      (``options``: :func:`omnireduce.integrations.fsdp.use_omnireduce`'s); returns an
      :class:`~omnireduce.integrations.fsdp.OmniReduceFSDP` (``stats()``, ``close()``).
    - a Hugging Face Transformers ``Trainer``: a callback that registers the hook with ``state`` (or
      one made from ``options``) when ``train()`` has wrapped the model; returns that state;
      :func:`omnireduce.integrations.transformers.use_omnireduce`.
    """
    if _torchrec.is_model_parallel(target):
        if state is not None:
            raise ValueError("a DistributedModelParallel gets one state per DDP: pass OmniReduceState's "
                             "arguments as keywords instead of a state")
        return _torchrec.use_omnireduce(target, hook, **options)
    if "mesh" in options or _fsdp.is_fsdp(target):
        if state is not None or hook is not omnireduce_hook:
            raise ValueError("an FSDP model takes no DDP state or hook: pass mesh= and use_omnireduce's options "
                             "(omnireduce.integrations.fsdp.use_omnireduce)")
        _fsdp.check_torch()
        if "mesh" not in options:
            raise TypeError("an FSDP model needs its 2-D DeviceMesh: use_omnireduce(model, mesh=mesh), the mesh "
                            "whose mesh['shard'] the model was sharded on")
        return _fsdp.use_omnireduce(target, **options)
    if hasattr(target, "add_callback"):  # a Transformers Trainer
        if state is not None and options:
            raise ValueError("pass either a state or OmniReduceState's arguments, not both")
        return _transformers.use_omnireduce(target, state if state is not None or not options
                                            else OmniReduceState(**options), hook)
    raise TypeError(f"use_omnireduce takes a Transformers Trainer or a TorchRec DistributedModelParallel (or, "
                    f"with mesh=, a model sharded with fully_shard), not {type(target).__name__} (for a "
                    f"DistributedDataParallel: ddp.register_comm_hook(OmniReduceState(), omnireduce_hook))")


def __getattr__(name: str) -> Any:
    if name == "OmniReduceDDPStrategy":  # Lightning is imported only when this is used
        from omnireduce.integrations import lightning

        cls = lightning.OmniReduceDDPStrategy
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
