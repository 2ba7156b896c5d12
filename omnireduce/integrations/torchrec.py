"""The omnireduce hook on every ``DistributedDataParallel`` of a TorchRec ``DistributedModelParallel``.

A ``DistributedModelParallel`` (DMP) reduces gradients through more than one DDP. Its dense part
(the MLPs) is wrapped in one, ``dmp._dmp_wrapped_module``, where TorchRec registers its own fp16/bf16
hooks. But each ``ShardedEmbeddingBagCollection`` (and the other sharded embedding modules) wraps its
DATA_PARALLEL lookups in DDPs of their own, held in a plain list (``_lookups``) that is not a
registered submodule, so ``named_modules()`` never finds them, and the tables' gradients, mostly zero
rows, are exactly what omnireduce is for. :func:`use_omnireduce` finds them all (:func:`find_ddps`:
the module tree, and the lists, tuples and dicts of modules that modules hold outside it) and
registers the hook on each, one :class:`~omnireduce.ddp.OmniReduceState` per DDP, every state a job
of its own at the same aggregators::

    model = DistributedModelParallel(dlrm, plan=plan, device=torch.device("cpu"))
    reduced = use_omnireduce(model)          # before the first forward
    ...train...
    print(reduced.stats())                   # summed over the DDPs, and per DDP
    reduced.close()

TorchRec itself is not imported here: the DMP is recognised by its class (see
:func:`is_model_parallel`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, cast

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, omnireduce_hook

__all__ = ["OmniReduceStates", "find_ddps", "is_model_parallel", "use_omnireduce"]

log = logging.getLogger("omnireduce.integrations")

#: The counters of :meth:`OmniReduceState.stats` that :meth:`OmniReduceStates.stats` adds up.
SUMMED = ("buckets_sparse", "buckets_dense", "buckets_failed", "buckets_probed", "buckets_coo", "bytes_sent",
          "bytes_received", "dense_equivalent_bytes", "bytes_in_node", "bytes_across_nodes",
          "collective_reductions", "collective_kernel_reductions", "rail_collective_reductions")


def is_model_parallel(obj: Any) -> bool:
    """Whether ``obj`` is a TorchRec ``DistributedModelParallel`` (or a subclass), without importing
    TorchRec (an object of its class means TorchRec is imported already)."""
    return any(cls.__name__ == "DistributedModelParallel" and cls.__module__.startswith("torchrec.")
               for cls in type(obj).__mro__)


def _held_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules ``module`` holds: its registered children, then those in the lists, tuples and
    dicts among its attributes (TorchRec's ``_lookups``), each with the name it is held under."""
    yield from module.named_children()
    for attr, value in vars(module).items():
        if attr in ("_modules", "_parameters", "_buffers"):
            continue
        if isinstance(value, (list, tuple)):
            items: Any = enumerate(value)
        elif isinstance(value, dict):
            items = value.items()
        else:
            continue
        for key, item in items:
            if isinstance(item, nn.Module):
                yield f"{attr}[{key}]", item


def find_ddps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``DistributedDataParallel`` inside ``model`` (itself included), with its path, in the same
    order on every rank: depth first through the modules ``model`` holds, registered or in lists,
    tuples and dicts (:func:`_held_modules`), each module once."""

    found: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        path, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, DistributedDataParallel):
            found.append((path, module))
        children = [(f"{path}.{name}" if path else name, child) for name, child in _held_modules(module)]
        stack.extend(reversed(children))
    return found


class OmniReduceStates:
    """The hook's states on a ``DistributedModelParallel``'s DDPs: what :func:`use_omnireduce` returns.

    ``states``: one :class:`~omnireduce.ddp.OmniReduceState` per DDP, the first (the dense part's,
    ``_dmp_wrapped_module``, where the DMP has one) owning the job's colocated aggregators if it
    started them; ``names``: each DDP's path in the DMP (``_dmp_wrapped_module``,
    ``..._lookups[0]``). :meth:`stats` adds their counters up; :meth:`close` closes them all."""

    def __init__(self, names: list[str], states: list[OmniReduceState]) -> None:
        self.names, self.states = names, states

    def stats(self) -> dict[str, Any]:
        """The counters of every state added up (``bytes_sent``, ``buckets_sparse``, ... as
        :meth:`OmniReduceState.stats` names them; ``sent_fraction`` of the sums), and ``per_ddp``:
        each DDP's path to its state's own ``stats()``."""
        per_ddp = {name: state.stats() for name, state in zip(self.names, self.states, strict=True)}
        out: dict[str, Any] = {key: sum(s.get(key, 0) for s in per_ddp.values()) for key in SUMMED}
        dense = out["dense_equivalent_bytes"]
        out["sent_fraction"] = out["bytes_sent"] / dense if dense else 0.0
        out["per_ddp"] = per_ddp
        return out

    def close(self) -> None:
        """Close the states: the others first, then the first, which stops the colocated aggregators it
        started once every worker has left them. Idempotent."""
        for state in self.states[1:]:
            state.close()
        if self.states:
            self.states[0].close()

    def __enter__(self) -> OmniReduceStates:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def use_omnireduce(model: nn.Module, hook: Any = omnireduce_hook, **options: Any) -> OmniReduceStates:
    """Register ``hook`` on every ``DistributedDataParallel`` of a TorchRec ``DistributedModelParallel``
    (its dense part's and its DATA_PARALLEL lookups'), one state per DDP, all at one set of
    aggregators; returns them as :class:`OmniReduceStates`.

    ``options`` are :class:`~omnireduce.ddp.OmniReduceState`'s (``aggregators``, ``path``,
    ``block_size``, ...), the same for every state. Call it on every rank, after
    ``torch.distributed`` is initialised and the DMP is made, before its first forward (DDP takes a
    hook only then): the states bind at once, the first starting the job's colocated aggregators
    when no addresses are configured. A model without DDP (one rank, or every table sharded
    otherwise and no dense part) logs a warning and changes nothing."""
    if options.get("worker") is not None:
        raise ValueError("each DDP's state needs a worker of its own: use_omnireduce takes no worker=")
    ddps = find_ddps(model)
    if not ddps:
        log.warning("omnireduce: no DistributedDataParallel in this model (one process, or nothing data "
                    "parallel?): gradients are reduced as TorchRec does by default")
        return OmniReduceStates([], [])
    first = OmniReduceState(**options)
    states = [first, *(first.sibling() for _ in ddps[1:])]  # (one job each, at the first one's aggregators)
    for (_, ddp), state in zip(ddps, states, strict=True):
        cast(DistributedDataParallel, ddp).register_comm_hook(state, hook)
    log.info("omnireduce: hook on %d DDP(s): %s", len(ddps), ", ".join(name or "(the model)" for name, _ in ddps))
    return OmniReduceStates([name for name, _ in ddps], states)
