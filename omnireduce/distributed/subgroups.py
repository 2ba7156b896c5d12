"""A process group of omnireduce's own beside each of the user's: the same ranks and backend, a timeout of
omnireduce's, and no collective of anyone else's on it.

Each group's reductions run on a thread of omnireduce's (:mod:`omnireduce.distributed.runtime`); on
the user's own group, collectives issued from that thread could interleave with the user's on some
rank and not on another. So each group gets a private copy, made on the group's first call, which is
collective as torch's ``new_group`` is:

- a group of every rank of the job (the default group, a full ``new_group``): ``dist.new_group`` over
  all ranks, which every rank calls on its first call on such a group, in the same order as its other
  group creations;
- a smaller group (a ``new_group`` of some ranks, a ``DeviceMesh`` dimension): only its own ranks call
  (``use_local_synchronization=True``; with NCCL on a bound device, ``split_group`` of the user's group),
  on their first call on it. Such groups are named by torch from the ranks and from how many groups
  each rank already holds; where the members hold different numbers (each is in other subgroups),
  :func:`_align_names` first gives the ones with fewer some one-rank groups, so that the members agree
  on the name.

Lifetime. The groups are held here weakly: a private group lives as long as torch's registry or a
runtime holds it, so ``torch.distributed.destroy_process_group()`` frees those of closed runtimes at
once. At interpreter exit, once the runtimes are closed, :func:`release` destroys those torch still
holds (a script need not call ``destroy_process_group()``). A Gloo group's worker threads end only when
the group is freed, and each drops its last collective's work (and so its tensors) some time after the
caller saw the collective complete; dropping a tensor that has a Python object takes the GIL on that
thread. Where that comes during the interpreter's shutdown, the thread cannot take the GIL and the
process aborts ("terminate called without an active exception") after a complete run. A group freed
while the interpreter is whole joins its threads with the GIL let go, so every such drop is done first.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import weakref
from typing import Any

import torch.distributed as dist

log = logging.getLogger("omnireduce.distributed")
# the private groups made so far and still alive, by id (held weakly: see "Lifetime" in the module)
_private: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_gloo: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()  # those on Gloo (:func:`release`)


def private_group(group: Any, timeout: float) -> Any:
    """A new process group of ``group``'s ranks and backend whose collectives fail after ``timeout``
    seconds (see the module; collective over ``group``'s ranks, or every rank for a whole-job group)."""
    ranks = dist.get_process_group_ranks(group)
    backend = dist.get_backend(group)
    limit = datetime.timedelta(seconds=timeout)
    if len(ranks) == dist.get_world_size():
        own = dist.new_group(ranks=ranks, backend=backend, timeout=limit)
    else:
        _align_names(group)
        if _splits(group):
            own = dist.split_group(parent_pg=group, split_ranks=[list(range(len(ranks)))], timeout=limit)
        else:
            own = dist.new_group(ranks=ranks, backend=backend, timeout=limit, use_local_synchronization=True)
    _private[id(own)] = own
    if str(backend).lower() == "gloo":
        _gloo[id(own)] = own
    return own


def is_private(group: Any) -> bool:
    """Whether ``group`` is one of these private groups: the engines' own collectives on it are torch's calls
    even where a program has put omnireduce's ``all_reduce`` in ``torch.distributed.all_reduce``'s place."""
    return group is not None and _private.get(id(group)) is group


def release() -> None:
    """Destroy every Gloo private group torch still holds and free it now (see "Lifetime" in the module):
    at interpreter exit, once nothing of omnireduce's runs on them. Local: no collective. A group that
    something else still holds is left to it (logged). NCCL groups are left to the program's
    ``destroy_process_group()``."""
    refs = [_destroyed(group) for group in list(_gloo.values())]
    _gloo.clear()
    if any(ref() is not None for ref in refs):  # (a reference cycle holds one: collected here, not at shutdown)
        gc.collect()
    held = sum(ref() is not None for ref in refs)
    if held:
        log.debug("omnireduce.distributed: %d private group(s) still held by the program at exit", held)


def _destroyed(group: Any) -> weakref.ref[Any]:
    """``group`` out of torch's registry (if still there); a weak reference to it."""
    with contextlib.suppress(ValueError):  # (no longer torch's: destroyed with the default group already)
        dist.destroy_process_group(group)
    return weakref.ref(group)


def _splits(group: Any) -> bool:
    """Whether the group is to be split rather than made anew: NCCL on a bound device (a new group made
    by its ranks alone would split the default group's communicator, which every rank must join)."""
    default = dist.distributed_c10d._get_default_group()
    return (hasattr(dist, "split_group") and getattr(default, "bound_device_id", None) is not None
            and "nccl" in str(dist.get_backend(group)).lower())


def _align_names(group: Any) -> None:
    """Make every member of ``group`` hold as many process groups as the one holding most (see the module),
    where this torch names a local group by that number; collective over ``group``."""
    c10d = dist.distributed_c10d
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None or not hasattr(c10d, "_hash_ranks_to_str"):
        return
    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(names), group=group)
    missing = max(counts) - len(names)
    if missing:
        log.debug("omnireduce.distributed: %d one-rank group(s) so that the ranks %s name their new group alike",
                  missing, dist.get_process_group_ranks(group))
    for _ in range(missing):
        dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
