"""The process groups omnireduce makes for an engine of the ranks' own, and their end.

An engine of the ranks' own runs on a process group no other collective uses, made for it
(collectively) by :meth:`omnireduce.engines.collective.CollectiveEngine.for_group` or by a DDP state's
binding (:mod:`omnireduce.ddp.binding`). torch's registry holds such a group until the program calls
``destroy_process_group()``, which a script need not do: the group then lives into the interpreter's
shutdown, where a Gloo worker thread still dropping its last collective's work (and so its tensors,
which takes the GIL) cannot take the GIL, and the process aborts ("terminate called without an active
exception") after a complete run. So the Gloo groups made here are recorded, and the engine running on
one destroys it once its thread has ended (:func:`release`): at its ``close()``, and at interpreter exit
at the latest, while the interpreter is whole. Freeing the group then joins its threads with the GIL let
go, so every such drop is done first.

Only groups made here, for one engine, are ever destroyed: never the program's, nor the groups a caller
hands binding (``engine_group``) or omnireduce.distributed's private groups (which
:mod:`omnireduce.distributed.subgroups` ends). NCCL groups are left to the program's
``destroy_process_group()``.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import weakref
from typing import Any

import torch.distributed as dist

log = logging.getLogger("omnireduce.collective")
# the Gloo groups made for an engine and not destroyed yet, by id (held weakly: the engine and torch hold them)
_made: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def new_group(ranks: list[int], backend: Any, timeout: float) -> Any:
    """``dist.new_group`` of ``ranks`` with ``backend`` (None: the default group's) whose collectives give
    up after ``timeout`` seconds (collective over the default group), for one engine alone: a Gloo group
    is destroyed with that engine (:func:`release`). A rank not among ``ranks`` gets torch's non-member
    value, recorded nowhere."""
    limit = datetime.timedelta(seconds=timeout)
    return _record(dist.new_group(ranks=ranks, backend=backend, timeout=limit))


def _record(group: Any) -> Any:
    if isinstance(group, dist.ProcessGroup) and str(dist.get_backend(group)).lower() == "gloo":
        _made[id(group)] = group
    return group


def release(group: Any) -> bool:
    """Destroy ``group`` if :func:`new_group` made it and it is on Gloo: out of torch's registry, so it
    is freed once its engine lets go of it. Local (no collective). Call only once nothing runs on it:
    the engine's thread has ended. Whether it was one of those (each is destroyed once)."""
    if group is None or _made.get(id(group)) is not group:
        return False
    del _made[id(group)]
    with contextlib.suppress(ValueError):  # (no longer torch's: the program destroyed it, or every group, first)
        dist.destroy_process_group(group)
    log.debug("destroyed the collective engine's own process group")
    return True
