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

The other layers' settings are read by their own modules, through the same readers
(:mod:`omnireduce.envvars`: unset and empty mean the default, a bad value names the variable):
the CUDA kernels' build in :mod:`omnireduce.cuda.build`, ``OMNIREDUCE_DEVICE_PATH`` in
:mod:`omnireduce.sources.adapt`, ``OMNIREDUCE_MALLOC_TUNE`` in :mod:`omnireduce._malloc`, the
launchers' in :mod:`omnireduce.launch.settings`; docs/configuration.md has the full table.

Rank and world size come from ``RANK``/``WORLD_SIZE`` (torchrun), else from mpi4py's
``COMM_WORLD`` when running under ``mpiexec`` (:mod:`omnireduce.placement`), else rank 0 of 1.
"""

from __future__ import annotations

import dataclasses

from omnireduce.credentials import check_curve_key, env_secret
from omnireduce.envvars import env as _env
from omnireduce.envvars import env_number as _env_number
from omnireduce.placement import mpi_rank_size

DEFAULT_BLOCK_SIZE = 256
DEFAULT_TIMEOUT = 60.0
DEFAULT_LOST_AFTER = 10.0  # seconds an aggregator may be unreachable before the ranks route around it
DEFAULT_LANES = 32768
DEFAULT_SLOTS = 4
DEFAULT_JOB = "default"


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
        mpi = mpi_rank_size()
        if mpi is not None:
            rank = mpi[0] if rank is None else rank
            world_size = mpi[1] if world_size is None else world_size
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not within world size {world_size}")
    return rank, world_size


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
