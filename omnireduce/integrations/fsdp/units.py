"""The FSDP modules of a model sharded with ``fully_shard(..., mesh=mesh["shard"])``, checked.

A *unit* is one FSDP state: what one ``fully_shard`` call made (on one module, or on a list of
modules that then share it), with its one parameter group. FSDP2 reduce-scatters each unit's
gradients in one collective and calls the unit's all-reduce hook once with the output, so a unit
is what the hook reduces across the replicas. :func:`find_units` finds them in a model, in the
order of ``named_modules()`` (the same on every rank: the unit's index is its key), and refuses
with a clear error what the hook cannot serve:

- a module with several parameter groups (per-parameter meshes from ``shard_placement_fn``):
  FSDP2's ``set_all_reduce_hook`` refuses them too;
- a unit sharded on a 2-D mesh (native HSDP already all-reduces across the replicas: shard on
  ``mesh["shard"]`` instead), replicated without sharding (``replicate``), or sharded on a 1-D
  mesh whose ranks are not those of ``mesh["shard"]``;
- a unit that already has an all-reduce hook (the user's own, or an earlier
  :func:`omnireduce.integrations.fsdp.use_omnireduce` not closed).

FSDP2's parameter groups and mesh infos are torch internals (``torch.distributed.fsdp._fully_shard``);
they are read here and nowhere else, so a torch that changes them fails here, saying so. A torch older
than :data:`NEEDS_TORCH` is refused by :func:`check_torch`, naming the version found and the one needed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from omnireduce.ddp.bucket import aligned_block_size

__all__ = ["NEEDS_TORCH", "Unit", "check_mesh", "check_torch", "find_units", "is_fsdp", "torch_release"]

DIM_NAMES = ("replicate", "shard")

#: The oldest torch the integration runs on. FSDP2's ``FSDPModule.set_all_reduce_hook`` came in torch 2.7
#: (the public ``torch.distributed.fsdp.fully_shard`` in 2.6, without it); on Gloo, torch 2.7 refuses
#: ``ReduceOp.AVG``, and torch 2.8's ``reduce_scatter_tensor`` takes AVG (and PREMUL_SUM) as a plain sum,
#: so FSDP2's own reduce-scatter hands the hook S times the shard group's mean (measured: 2.8.0 sums,
#: 2.9.1 averages). With 2.9 the integration is tested, against native HSDP, on Gloo.
NEEDS_TORCH = (2, 9)
_WHY_TORCH = ("FSDP2's all-reduce hook came in 2.7; torch 2.8's Gloo reduce-scatter returns the sum where FSDP2 "
              "asks for the average")


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``"2.10.0+cu128"`` -> ``(2, 10)``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m[1]), int(m[2])


def check_torch() -> None:
    """Refuse (RuntimeError) a torch older than :data:`NEEDS_TORCH`, naming the version found and the one needed."""
    found = str(torch.__version__)
    if torch_release(found) < NEEDS_TORCH:
        raise RuntimeError(f"omnireduce's FSDP2 integration needs torch {NEEDS_TORCH[0]}.{NEEDS_TORCH[1]} or later "
                           f"({_WHY_TORCH}); this is torch {found}")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One FSDP unit (see the module): ``key`` its index, ``name`` its first module's path
    (``""`` for the root) and ``module`` that module, ``group`` FSDP2's parameter group (the hook
    reads its gradient divide factor and ``all_reduce_grads`` there), ``numel`` the elements of
    its reduce-scatter output when every parameter has a gradient, and ``block_size`` the blocks'
    size for that output."""

    key: int
    name: str
    module: Any
    group: Any
    numel: int
    block_size: int

    def block_size_for(self, numel: int, base: int) -> int:
        """The block size of a reduce-scatter output of ``numel`` elements: the unit's own (aligned
        to its dominant row width) when every parameter is in it, else ``base`` (some parameter had
        no gradient this step, so the rows sit elsewhere; the same on every rank, as the output is)."""
        return self.block_size if numel == self.numel else base


def _fsdp_module_class() -> type[Any] | None:
    """FSDP2's module class (None: a torch without FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule  # torch 2.6 and later
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4 and 2.5
        except ImportError:
            return None
    return FSDPModule


def is_fsdp(obj: Any) -> bool:
    """Whether ``obj`` is a module sharded with FSDP2's ``fully_shard`` or holds one."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(obj, nn.Module):
        return False
    return any(isinstance(m, cls) for m in obj.modules())


def check_mesh(mesh: Any) -> None:
    """Refuse (ValueError/TypeError) a mesh that is not 2-D with dimensions named ("replicate", "shard")."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"use_omnireduce(module, mesh=...) takes the 2-D DeviceMesh the model's shard mesh was "
                        f"cut from, not {type(mesh).__name__}")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != DIM_NAMES:
        raise ValueError(f"omnireduce's HSDP needs a 2-D DeviceMesh with mesh_dim_names=('replicate', 'shard') "
                         f"(init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', "
                         f"'shard'))), got {mesh.ndim}-D with names {mesh.mesh_dim_names}")


def find_units(model: nn.Module, mesh: Any, base_block_size: int, align: bool) -> list[Unit]:
    """Every FSDP unit of ``model`` (itself included), checked against ``mesh`` (see the module);
    raises ValueError naming the module for anything not supported, TypeError when ``model`` holds
    no FSDP module."""
    check_torch()
    check_mesh(mesh)
    cls = _fsdp_module_class()
    assert cls is not None  # (check_torch: FSDP2 is there)
    shard_ranks = dist.get_process_group_ranks(mesh.get_group("shard"))
    units: list[Unit] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not isinstance(module, cls):
            continue
        state = _state(cast(nn.Module, module))
        if id(state) in seen:  # (fully_shard([a, b]): one unit, found at a first)
            continue
        seen.add(id(state))
        groups = _param_groups(state)
        where = f"FSDP module {name or '(the model)'!r}"
        if len(groups) > 1:
            raise ValueError(f"{where} has {len(groups)} parameter groups (per-parameter meshes from "
                             "shard_placement_fn): FSDP2's all-reduce hook serves one group per module, and "
                             "omnireduce's HSDP does not support per-parameter meshes")
        if not groups:  # (no parameters of its own: nothing reduced for it)
            continue
        group = groups[0]
        _check_group(group, where, shard_ranks)
        numel, block = _layout(group, base_block_size, align)
        units.append(Unit(key=len(units), name=name, module=module, group=group, numel=numel, block_size=block))
    if not seen:
        raise TypeError(f"use_omnireduce(module, mesh=...): {type(model).__name__} holds no module sharded with "
                        "fully_shard(..., mesh=mesh['shard'])")
    return units


def _state(module: nn.Module) -> Any:
    try:
        state = module._get_fsdp_state()  # type: ignore[operator]
        _param_groups(state)
    except (AttributeError, AssertionError) as e:
        raise RuntimeError(f"omnireduce's FSDP integration does not know this torch's FSDP2 internals "
                           f"({type(e).__name__}: {e})") from e
    return state


def _param_groups(state: Any) -> list[Any]:
    """The module's FSDP parameter groups: a list in torch 2.13 (``_fsdp_param_groups``, several with
    per-parameter meshes), at most one before (``_fsdp_param_group``, torch 2.11 and earlier)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def _check_group(group: Any, where: str, shard_ranks: list[int]) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    info = group.mesh_info
    if isinstance(info, DDPMeshInfo):
        what = "a 2-D mesh (native HSDP: FSDP2 all-reduces across the replicas itself)" \
            if isinstance(info, FSDPMeshInfo) else "a replicate-only mesh (no sharding)"
        raise ValueError(f"{where} is sharded on {what}: shard it with fully_shard(..., mesh=mesh['shard']) and "
                         "omnireduce reduces across mesh['replicate']")
    if not isinstance(info, FSDPMeshInfo):
        raise ValueError(f"{where}: unknown FSDP2 mesh info {type(info).__name__}")
    ranks = dist.get_process_group_ranks(info.shard_process_group)
    if ranks != shard_ranks:
        raise ValueError(f"{where} is sharded over ranks {ranks}, but mesh['shard'] holds ranks {shard_ranks} on this "
                         "rank: shard every module with fully_shard(..., mesh=mesh['shard']) of the mesh given here")
    if getattr(group, "_all_reduce_hook", None) is not None:
        raise ValueError(f"{where} already has an all-reduce hook (set_all_reduce_hook, or an earlier use_omnireduce "
                         "whose handle was not closed): one hook per module")


def _layout(group: Any, base: int, align: bool) -> tuple[int, int]:
    """The unit's reduce-scatter output: its elements when every parameter has a gradient, and its
    block size (aligned to the rows of its dominant parameter when ``align``). Each parameter's part
    is its padded shard: rows ``ceil(dim0 / shards)`` of the unsharded shape's rest (Shard(0)); a
    parameter sharded on another dimension counts as a flat run of its elements."""
    shapes: list[tuple[int, ...]] = []
    for p in group.fsdp_params:
        if not p.sharded_param.requires_grad:  # (frozen: never reduce-scattered)
            continue
        size = tuple(p.padded_sharded_param_size)
        placement = getattr(p, "fsdp_placement", None)
        shapes.append(size if getattr(placement, "dim", 0) == 0 else (math.prod(size),))
    numel = sum(math.prod(s) for s in shapes)
    return numel, aligned_block_size(shapes, base) if align else base
