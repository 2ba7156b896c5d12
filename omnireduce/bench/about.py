"""The benchmark's header: where and with what it ran (every number goes with it)."""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist

from omnireduce.bench.launch import gathered
from omnireduce.config import env_aggregators
from omnireduce.version import __version__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.0f} GiB), {torch.cuda.device_count()} on this node"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def header(backend: str, device: torch.device, argv: list[str]) -> dict[str, Any]:
    """The run's header (collective: every rank's host is gathered)."""
    hosts = gathered(socket.gethostname())
    nccl = None
    if "nccl" in backend and torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    aggregators = env_aggregators()
    return {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["omnireduce-bench", *argv]),
        "device": _device_name(device),
        "backend": backend + (f" (NCCL {nccl})" if nccl else ""),
        "world_size": dist.get_world_size(),
        "nodes": len(set(hosts)),
        "ranks_per_node": max(hosts.count(h) for h in set(hosts)),
        "torch": torch.__version__,
        "omnireduce": __version__,
        "python": platform.python_version(),
        "host": hosts[0],
        "aggregators": len(aggregators.split(",")) if aggregators else 0,
        "emulated": bool(os.environ.get("NCCL_HOSTID")),
        "argv": sys.argv[1:],
    }


def lines(head: dict[str, Any]) -> list[str]:
    """The header as comment lines."""
    out = [f"# omnireduce-bench, {head['time']}: {head['command']}",
           f"# device {head['device']}",
           f"# backend {head['backend']}, world size {head['world_size']}, {head['nodes']} node(s), "
           f"{head['ranks_per_node']} rank(s) per node" + (" (NCCL_HOSTID per rank: an emulated network on one "
                                                           "device)" if head["emulated"] else ""),
           f"# torch {head['torch']}, omnireduce {head['omnireduce']}, python {head['python']}"]
    if head["aggregators"]:
        out.append(f"# aggregators: {head['aggregators']} (OMNIREDUCE_AGGREGATORS)")
    return out
