"""The launchers' environment readers (``omnireduce-run``, its children, the colocated aggregators).

Each reads one variable the same way for every process that needs it, through
:mod:`omnireduce.envvars`, and a bad value raises ValueError naming the variable.
"""

from __future__ import annotations

import os

from omnireduce.envvars import env, env_number

RUN_DIR_VAR = "OMNIREDUCE_RUN_DIR"
"""Set by ``omnireduce-run`` for its workers: the directory where each records its exit code."""


def env_socket_buffer() -> int:
    """``OMNIREDUCE_SOCKET_BUFFER``: TCP send/receive buffer per connection, bytes; 0 (unset) or less:
    the kernel's autotuning. Read as :meth:`omnireduce.config.WorkerConfig.resolve` reads it."""
    return int(env_number("OMNIREDUCE_SOCKET_BUFFER", int, 0))


def env_aggregators_per_node() -> int:
    """``OMNIREDUCE_AGGREGATORS_PER_NODE``: aggregators each node of a job starts for itself (default 1)."""
    value = int(env_number("OMNIREDUCE_AGGREGATORS_PER_NODE", int, 1))
    if value < 1:
        raise ValueError(f"environment variable OMNIREDUCE_AGGREGATORS_PER_NODE={value} must be >= 1")
    return value


def env_ifname() -> str | None:
    """``OMNIREDUCE_IFNAME``: the network interface whose address a node's own aggregators listen on
    (None: unset). Must be a valid Linux interface name (1 to 15 bytes; no ``/``, ``:`` or space)."""
    name = env("OMNIREDUCE_IFNAME")
    if name is not None and (len(name.encode()) > 15 or name in (".", "..")
                             or any(c in "/:" or c.isspace() for c in name)):
        raise ValueError(f"environment variable OMNIREDUCE_IFNAME={name!r} is not a network interface name "
                         "(1 to 15 bytes; no '/', ':' or whitespace)")
    return name


def env_run_dir() -> str | None:
    """``OMNIREDUCE_RUN_DIR`` (:data:`RUN_DIR_VAR`): where ``omnireduce-run``'s workers record their
    exit codes (None: unset, not run by ``omnireduce-run``). Must be an existing directory."""
    run_dir = env(RUN_DIR_VAR)
    if run_dir is not None and not os.path.isdir(run_dir):
        raise ValueError(f"environment variable {RUN_DIR_VAR}={run_dir!r} is not a directory")
    return run_dir
