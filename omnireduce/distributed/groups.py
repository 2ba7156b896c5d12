"""One runtime per process group: built on the group's first call, closed by :func:`shutdown` or at exit.

The first call omnireduce takes on a group builds the group's runtime: its private copy of the group
(:mod:`omnireduce.distributed.subgroups`), its reducer (:mod:`omnireduce.distributed.reducers`) and
its thread (:mod:`omnireduce.distributed.runtime`). That first call is collective, as torch's
``new_group`` is: every rank of the group makes it in the same order (and for a group of every rank of
the job, in the same order as its other group creations). Later calls find the runtime here.

:func:`shutdown` closes one group's runtime, or all of them: the thread ends once the calls queued are
done, the engine lets go of its group, the worker leaves its aggregators. A later call on the group
builds a new runtime (collective again). The private groups themselves are destroyed with the
others by ``torch.distributed.destroy_process_group()``. At interpreter exit, while the interpreter is
still whole (:mod:`omnireduce.exits`, stage ``RELEASE``), every runtime still open is closed and then
the Gloo private groups torch still holds are destroyed and freed
(:func:`omnireduce.distributed.subgroups.release`): their threads end before the interpreter's shutdown,
which they could otherwise abort. A new default group (``init_process_group`` again, after a
``destroy_process_group``) closes the runtimes of the old one. Nothing here holds a process group of
the program's once its runtime is closed: ``destroy_process_group()`` frees the groups there and then.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch.distributed as dist

from omnireduce.config import env_timeout
from omnireduce.distributed import reducers, subgroups
from omnireduce.distributed.runtime import GroupRuntime
from omnireduce.exits import RELEASE, at_exit

log = logging.getLogger("omnireduce.distributed")
_lock = threading.RLock()
_runtimes: dict[Any, GroupRuntime] = {}
# the default group the runtimes were built under (weakly: the program's group is not kept alive here)
_world: list[weakref.ref[Any] | None] = [None]
_registered: list[bool] = [False]


def runtime_for(group: Any) -> GroupRuntime:
    """The runtime of ``group`` (None: the default group), built on its first call (collective)."""
    key = group if group is not None else dist.group.WORLD
    with _lock:
        world = dist.group.WORLD
        if _world[0] is None or _world[0]() is not world:  # (a new default group: the old runtimes' are gone)
            _close_all()
            _world[0] = weakref.ref(world) if world is not None else None
        runtime = _runtimes.get(key)
        if runtime is None:
            runtime = _runtimes[key] = _build(key)
        return runtime


def _build(group: Any) -> GroupRuntime:
    timeout = env_timeout()
    own = subgroups.private_group(group, timeout)
    made = reducers.make(own, timeout)
    runtime = GroupRuntime(group, own, made, timeout)
    if not _registered[0]:
        at_exit(RELEASE, _release_at_exit)
        _registered[0] = True
    log.info("omnireduce.distributed: the group of global ranks %s reduces through the %s", runtime.ranks,
             "aggregators" if made.way == "aggregators" else "collective engine")
    return runtime


def shutdown(group: Any = None) -> None:
    """Close the runtime of ``group`` (see the module), or with no group every runtime. Local: no
    collective. Call it before ``torch.distributed.destroy_process_group()`` (or let the exit do it)."""
    if group is None:
        _close_all()
        return
    with _lock:
        runtime = _runtimes.pop(group, None)
    if runtime is not None:
        runtime.close()


def stats(group: Any = None) -> dict[str, Any]:
    """What the reducer of ``group`` (None: the default group) has done so far: its way (``collective`` or
    ``aggregators``) and its counters (bytes sent and received, reductions, ...); empty before the
    group's first call."""
    key = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    with _lock:
        runtime = _runtimes.get(key)
    if runtime is None:
        return {}
    return {"way": runtime.way, **runtime.made.stats()}


def _release_at_exit() -> None:
    """At interpreter exit: every runtime closed, then the private groups destroyed and freed (see the module)."""
    _close_all()
    subgroups.release()


def _close_all() -> None:
    with _lock:
        runtimes = list(_runtimes.values())
        _runtimes.clear()
    for runtime in runtimes:
        runtime.close()
