"""The kept name of :mod:`omnireduce.launch.colocate` (a job's own aggregators): its public names.

``from omnireduce.colocate import start_colocated`` keeps working; the code lives in
:mod:`omnireduce.launch.colocate`. Nothing but these re-exports belongs here.
"""

from __future__ import annotations

from omnireduce.launch.colocate import (
    Colocated,
    exiting_on_error,
    interface_address,
    reachable_host,
    start_colocated,
)
from omnireduce.placement import node_name

__all__ = ["Colocated", "exiting_on_error", "interface_address", "node_name", "reachable_host", "start_colocated"]
