"""Worker configuration: explicit arguments first, then environment variables, then defaults.

Environment variables (the aggregator reads ``OMNIREDUCE_TOKEN`` / ``OMNIREDUCE_TOKEN_FILE`` the same
way, through :mod:`omnireduce.credentials`):

``OMNIREDUCE_AGGREGATORS``  comma-separated aggregator addresses (``tcp://host:port,...``); the DDP
                           hook starts the job's own (omnireduce.colocate) when it is unset
``OMNIREDUCE_TOKEN``        shared secret checked by the aggregators
``OMNIREDUCE_TOKEN_FILE``   a file holding it (used when ``OMNIREDUCE_TOKEN`` is not set)
``OMNIREDUCE_CURVE_SERVER_KEY`` (or ``..._FILE``)  the aggregators' zmq CURVE public key: encrypt
``OMNIREDUCE_SOCKET_BUFFER`` TCP send/receive buffer per connection, bytes (default: the kernel's
                           autotuning). A small one (e.g. 131072) bounds what several aggregators
                           can have in flight towards one worker at once (TCP incast into a
                           shallow switch buffer)
``OMNIREDUCE_BLOCK_SIZE``   elements per block (default 256)
``OMNIREDUCE_TIMEOUT``      seconds for first contact and for each tensor (default 60)
``OMNIREDUCE_LOST_AFTER``   seconds an aggregator may be unreachable before this rank routes its slots
                           to the other aggregators (default 10; at most half the timeout)
``OMNIREDUCE_JOB``          job name (default ``default``); ranks of one training run share it
``OMNIREDUCE_LANES``        most lanes per slot (default 32768): blocks one slot aggregates per round
``OMNIREDUCE_SLOTS``        most slots per tensor (default: 4 or the number of aggregators if more):
                           independent pipelines, slot ``s`` served by aggregator ``s mod A``
``OMNIREDUCE_RETAIN_MB``    finished tensors' sums kept for replays after a restart (default 512)
``OMNIREDUCE_HIERARCHICAL`` ``auto`` (default), ``1`` or ``0``: the DDP hook's default for
                           ``hierarchical`` (sum inside the node first, then across nodes by rail)

Read here too, for the modules named (every ``OMNIREDUCE_*`` variable is read in this module, so a
bad value gives the same clear error wherever it is used; docs/configuration.md has the full table):

``OMNIREDUCE_CUDA_KERNELS`` ``auto``, ``require`` or ``off`` (omnireduce.cuda_kernels)
``OMNIREDUCE_CUDA_BUILD_DIR``, ``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT``  where the kernels are cached,
                           how long a build waits for another process's (omnireduce.cuda_kernels)
``OMNIREDUCE_DEVICE_PATH``  ``1``: CPU torch tensors take the device path (omnireduce.worker.tensors)
``OMNIREDUCE_MALLOC_TUNE``  ``0``: leave glibc's allocator alone (omnireduce.worker.client)

Rank and world size come from ``RANK``/``WORLD_SIZE`` (torchrun), else from mpi4py's
``COMM_WORLD`` when running under ``mpiexec``, else rank 0 of 1.
"""

from __future__ import annotations

import dataclasses
import os

from omnireduce.credentials import check_curve_key, env_secret

DEFAULT_BLOCK_SIZE = 256
DEFAULT_TIMEOUT = 60.0
DEFAULT_LOST_AFTER = 10.0  # seconds an aggregator may be unreachable before the ranks route around it
DEFAULT_LANES = 32768
DEFAULT_SLOTS = 4
DEFAULT_JOB = "default"


def _env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def _env_number(name: str, kind: type, default: float | int) -> float | int:
    raw = _env(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {kind.__name__}") from None


def env_timeout() -> float:
    """``OMNIREDUCE_TIMEOUT`` (seconds; default 60)."""
    return float(_env_number("OMNIREDUCE_TIMEOUT", float, DEFAULT_TIMEOUT))


def env_hierarchical() -> bool | None:
    """``OMNIREDUCE_HIERARCHICAL``: ``auto`` (default: None, the hierarchy runs where some node holds
    several ranks), ``1`` (True) or ``0`` (False)."""
    raw = (_env("OMNIREDUCE_HIERARCHICAL") or "auto").strip().lower()
    values = {"auto": None, "1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
    if raw not in values:
        raise ValueError(f"OMNIREDUCE_HIERARCHICAL must be auto, 1 or 0; got {raw!r}")
    return values[raw]


def env_job() -> str | None:
    """``OMNIREDUCE_JOB``, if set."""
    return _env("OMNIREDUCE_JOB")


def env_aggregators() -> str | None:
    """``OMNIREDUCE_AGGREGATORS`` as given (comma-separated addresses), if set."""
    return _env("OMNIREDUCE_AGGREGATORS")


_CUDA_KERNELS_MODES = {"": "auto", "auto": "auto", "1": "auto", "require": "require", "0": "off", "off": "off"}
DEFAULT_CUDA_BUILD_LOCK_TIMEOUT = 600.0  # seconds; a build takes about a minute, several on a loaded machine


def cuda_kernels_mode() -> str:
    """``OMNIREDUCE_CUDA_KERNELS``: ``auto`` (default), ``require`` or ``off``."""
    raw = (_env("OMNIREDUCE_CUDA_KERNELS") or "").strip().lower()
    if raw not in _CUDA_KERNELS_MODES:
        raise ValueError(f"OMNIREDUCE_CUDA_KERNELS must be auto, require or off; got {raw!r}")
    return _CUDA_KERNELS_MODES[raw]


def cuda_build_lock_timeout() -> float:
    """``OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT``: seconds >= 0 a build waits for another process's."""
    raw = (_env("OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT") or "").strip()
    if not raw:
        return DEFAULT_CUDA_BUILD_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0.0:
        raise ValueError(f"OMNIREDUCE_CUDA_BUILD_LOCK_TIMEOUT must be a number of seconds >= 0, got {raw!r}")
    return value


def cuda_build_dir() -> str | None:
    """``OMNIREDUCE_CUDA_BUILD_DIR``, if set: where the built kernels are cached."""
    return _env("OMNIREDUCE_CUDA_BUILD_DIR")


def device_path_for_cpu() -> bool:
    """``OMNIREDUCE_DEVICE_PATH=1``: CPU torch tensors take the device path (with torch ops)."""
    return _env("OMNIREDUCE_DEVICE_PATH") == "1"


def malloc_tune() -> bool:
    """``OMNIREDUCE_MALLOC_TUNE`` (default on; ``0`` turns it off): keep freed buffers for reuse."""
    return _env("OMNIREDUCE_MALLOC_TUNE") != "0"


def parse_addresses(spec: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """Aggregator addresses from a list or a comma-separated string; checks each is ``tcp://host:port``."""
    if spec is None:
        spec = env_aggregators()
        if spec is None:
            raise ValueError("no aggregator addresses: pass aggregators=[...] or set OMNIREDUCE_AGGREGATORS "
                             "(e.g. tcp://10.0.0.1:5555,tcp://10.0.0.2:5555), or let the job run its own: "
                             "omnireduce.colocate.start_colocated(group) after init_process_group gives "
                             "every rank their addresses and token (the DDP hook does this by itself)")
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = [a.strip() for a in items if a.strip()]
    if not out:
        raise ValueError(f"no aggregator addresses in {spec!r}")
    for a in out:
        scheme, _, rest = a.partition("://")
        if scheme not in ("tcp", "ipc", "inproc") or not rest:
            raise ValueError(f"aggregator address {a!r} is not of the form tcp://HOST:PORT")
        if scheme == "tcp":
            host, sep, port = rest.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"aggregator address {a!r}: expected tcp://HOST:PORT with a port in 1-65535")
    return out


def rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size from the arguments, torchrun's variables, or MPI."""
    if rank is None and _env("RANK") is not None:
        rank = int(_env_number("RANK", int, 0))
    if world_size is None and _env("WORLD_SIZE") is not None:
        world_size = int(_env_number("WORLD_SIZE", int, 1))
    if rank is None or world_size is None:
        mpi = _mpi_rank_size()
        if mpi is not None:
            rank = mpi[0] if rank is None else rank
            world_size = mpi[1] if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not within world size {world_size}")
    return rank, world_size


def _mpi_rank_size() -> tuple[int, int] | None:
    """(rank, size) from MPI if this process was started by an MPI launcher, else None."""
    launched = any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                             "PMIX_RANK", "MPI_LOCALRANKID", "HYDI_CONTROL_FD"))
    if not launched:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    return comm.Get_rank(), comm.Get_size()


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs, resolved and validated."""

    aggregators: tuple[str, ...]
    rank: int
    world_size: int
    job: str = DEFAULT_JOB
    block_size: int = DEFAULT_BLOCK_SIZE
    timeout: float = DEFAULT_TIMEOUT
    token: str | None = None
    lanes: int = DEFAULT_LANES
    slots: int = DEFAULT_SLOTS
    threshold: float = 0.0
    curve_server_key: str | None = None  # Z85 public key of the aggregators: encrypt with zmq CURVE
    socket_buffer: int = 0  # SO_SNDBUF/SO_RCVBUF of each connection; 0: the kernel's autotuning
    retain_bytes: int = 512 << 20  # finished tensors' sums kept for replays (OMNIREDUCE_RETAIN_MB)
    lost_after: float = DEFAULT_LOST_AFTER  # an aggregator unreachable this long is routed around

    @property
    def lost_seconds(self) -> float:
        """How long an aggregator may be unreachable before this rank routes around it: ``lost_after``,
        and at most half the timeout (so that its tensors still make their deadline elsewhere)."""
        return min(self.lost_after, self.timeout / 2)

    @classmethod
    def resolve(cls, aggregators: str | list[str] | None = None, rank: int | None = None,
                world_size: int | None = None, job: str | None = None, block_size: int | None = None,
                timeout: float | None = None, token: str | None = None, lanes: int | None = None,
                slots: int | None = None, threshold: float = 0.0, without_aggregators: bool = False) -> WorkerConfig:
        """The configuration from the arguments, the environment and the defaults, validated.
        ``without_aggregators``: the layout of blocks, lanes and slots alone, with no aggregator
        addresses (what the collective engine needs: the ranks are the aggregators)."""
        from omnireduce.wire import MAX_BLOCK_SIZE, MAX_LANES, MAX_SLOTS

        rank, world_size = rank_and_world_size(rank, world_size)
        addresses = () if without_aggregators else tuple(parse_addresses(aggregators))
        cfg = cls(
            aggregators=addresses,
            rank=rank,
            world_size=world_size,
            job=job if job is not None else (env_job() or DEFAULT_JOB),
            block_size=int(block_size if block_size is not None
                           else _env_number("OMNIREDUCE_BLOCK_SIZE", int, DEFAULT_BLOCK_SIZE)),
            timeout=float(timeout if timeout is not None
                          else _env_number("OMNIREDUCE_TIMEOUT", float, DEFAULT_TIMEOUT)),
            token=token if token is not None else env_secret("OMNIREDUCE_TOKEN"),
            lanes=int(lanes if lanes is not None else _env_number("OMNIREDUCE_LANES", int, DEFAULT_LANES)),
            slots=int(slots if slots is not None
                      else _env_number("OMNIREDUCE_SLOTS", int, max(DEFAULT_SLOTS, len(addresses)))),
            threshold=float(threshold),
            curve_server_key=env_secret("OMNIREDUCE_CURVE_SERVER_KEY"),
            socket_buffer=int(_env_number("OMNIREDUCE_SOCKET_BUFFER", int, 0)),
            retain_bytes=int(float(_env_number("OMNIREDUCE_RETAIN_MB", float, 512)) * (1 << 20)),
            lost_after=float(_env_number("OMNIREDUCE_LOST_AFTER", float, DEFAULT_LOST_AFTER)),
        )
        if not 1 <= cfg.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {cfg.block_size}")
        if not 1 <= cfg.lanes <= MAX_LANES:
            raise ValueError(f"lanes must be in 1..{MAX_LANES}, got {cfg.lanes}")
        if not 1 <= cfg.slots <= MAX_SLOTS:
            raise ValueError(f"slots must be in 1..{MAX_SLOTS}, got {cfg.slots}")
        if not cfg.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {cfg.timeout}")
        if not cfg.lost_after > 0:
            raise ValueError(f"OMNIREDUCE_LOST_AFTER must be > 0 seconds, got {cfg.lost_after}")
        if cfg.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {cfg.threshold}")
        check_curve_key(cfg.curve_server_key, "OMNIREDUCE_CURVE_SERVER_KEY", "public")
        if not cfg.job or len(cfg.job.encode()) > 256:
            raise ValueError("job name must be 1 to 256 bytes")
        return cfg


# --------------------------------------------------------------------------------------------
# Environment readers of the launchers (colocate.py, run.py, _child.py): each reads one variable the
# same way for every process that needs it, and a bad value raises ValueError naming the variable.

RUN_DIR_VAR = "OMNIREDUCE_RUN_DIR"
"""Set by ``omnireduce-run`` for its workers: the directory where each records its exit code."""


def env_socket_buffer() -> int:
    """``OMNIREDUCE_SOCKET_BUFFER``: TCP send/receive buffer per connection, bytes; 0 (unset) or less:
    the kernel's autotuning. Read as :meth:`WorkerConfig.resolve` reads it."""
    return int(_env_number("OMNIREDUCE_SOCKET_BUFFER", int, 0))


def env_aggregators_per_node() -> int:
    """``OMNIREDUCE_AGGREGATORS_PER_NODE``: aggregators each node of a job starts for itself (default 1)."""
    value = int(_env_number("OMNIREDUCE_AGGREGATORS_PER_NODE", int, 1))
    if value < 1:
        raise ValueError(f"environment variable OMNIREDUCE_AGGREGATORS_PER_NODE={value} must be >= 1")
    return value


def env_ifname() -> str | None:
    """``OMNIREDUCE_IFNAME``: the network interface whose address a node's own aggregators listen on
    (None: unset). Must be a valid Linux interface name (1 to 15 bytes; no ``/``, ``:`` or space)."""
    name = _env("OMNIREDUCE_IFNAME")
    if name is not None and (len(name.encode()) > 15 or name in (".", "..")
                             or any(c in "/:" or c.isspace() for c in name)):
        raise ValueError(f"environment variable OMNIREDUCE_IFNAME={name!r} is not a network interface name "
                         "(1 to 15 bytes; no '/', ':' or whitespace)")
    return name


def env_run_dir() -> str | None:
    """``OMNIREDUCE_RUN_DIR`` (:data:`RUN_DIR_VAR`): where ``omnireduce-run``'s workers record their
    exit codes (None: unset, not run by ``omnireduce-run``). Must be an existing directory."""
    run_dir = _env(RUN_DIR_VAR)
    if run_dir is not None and not os.path.isdir(run_dir):
        raise ValueError(f"environment variable {RUN_DIR_VAR}={run_dir!r} is not a directory")
    return run_dir
