"""Starting W ranks with ``mpiexec`` (MPICH's hydra), on loopback or one per emulated worker host.

On loopback, ``mpiexec -n W`` starts them here. MPI then moves its bytes through the kernel's TCP
stack like Gloo and omnireduce do (UCX over TCP, MPICH's shared memory off: ``MPIR_CVAR_NOLOCAL=1``,
``UCX_TLS=tcp,self``), unless the transport is ``auto`` (MPICH's defaults, shared memory between
ranks).

In an emulated network, ``mpiexec`` runs in worker 0's namespace with ``-hosts <worker addresses>
-ppn 1 -iface <interface> -launcher ssh -launcher-exec <script>``: the script (:data:`NETNS_LAUNCHER`,
written to a scratch directory) turns hydra's ``ssh [-x] HOST CMD`` into ``ip netns exec <HOST's
namespace> sh -c CMD``, so that each hydra proxy, and the rank it starts, runs in its own host's
namespace and connects back to mpiexec over the emulated links. MPI runs over UCX's TCP transport
on the emulated interface only (``UCX_NET_DEVICES``): otherwise UCX would reach the other ranks
through shared memory or CMA and bypass the shaped links.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from ombench.network import Network

# hydra's ssh launcher runs `<launcher-exec> [-x] HOST CMD...`; run CMD inside HOST's namespace instead.
NETNS_LAUNCHER = r"""#!/bin/sh
# Written by ombench.mpi for mpiexec -launcher ssh -launcher-exec <this>.
# Called as: <this> [ssh options] HOST CMD...; runs CMD in the network namespace that
# $BENCH_NETNS_MAP ("addr=netns,addr=netns,...") gives for HOST.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=$1
shift
for pair in $(echo "$BENCH_NETNS_MAP" | tr ',' ' '); do
    if [ "${pair%%=*}" = "$host" ]; then
        exec ip netns exec "${pair#*=}" sh -c "$*"
    fi
done
echo "bench_allreduce netns launcher: no namespace for host '$host'" >&2
exit 1
"""


def mpi_environment(transport: str, interface: str | None) -> dict[str, str]:
    """Environment for MPICH/UCX: TCP only (on ``interface`` when given), or MPICH's defaults (``auto``)."""
    if transport == "auto":
        return {}
    env = {"MPIR_CVAR_CH4_NETMOD": "ucx", "MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self",
           "UCX_WARN_UNUSED_ENV_VARS": "n"}
    if interface:
        env["UCX_NET_DEVICES"] = interface
    return env


def find_mpiexec() -> str:
    """The ``mpiexec`` next to this interpreter (pip's mpich), else the first on ``PATH``.

    Raises ``FileNotFoundError`` (saying what to install) when there is none.
    """
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("mpiexec not found: pip install mpi4py mpich (or leave 'mpi' out of --methods)")
    return found


def start_mpiexec(net: Network, rank_cmd: list[str], world: int, transport: str,
                  scratch: Path) -> subprocess.Popen[Any]:
    """Start ``rank_cmd`` as ``world`` MPI ranks in ``net`` (see the module docstring); returns mpiexec.

    ``transport`` (``tcp`` or ``auto``) applies to loopback; an emulated network always uses TCP on
    its interface. The launcher script, if needed, is written to ``scratch``.
    """
    mpiexec = find_mpiexec()
    if net.cluster is None:
        env = {**os.environ, **mpi_environment(transport, None)}
        return net.popen(0, [mpiexec, "-n", str(world), *rank_cmd], env=env)
    launcher = scratch / "netns_launcher.sh"
    launcher.write_text(NETNS_LAUNCHER)
    launcher.chmod(0o700)
    workers = net.cluster.workers
    env = {**os.environ, **mpi_environment("tcp", net.interface),
           "BENCH_NETNS_MAP": ",".join(f"{h.address}={h.name}" for h in workers)}
    argv = [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher), "-iface", net.interface,
            "-hosts", ",".join(h.address for h in workers), "-ppn", "1", "-n", str(world), *rank_cmd]
    return net.popen(0, argv, env=env)
