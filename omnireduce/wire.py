"""The wire format: one fixed, versioned header frame followed by raw array frames, as typed messages.

Every message is a zmq multipart message. Frame 0 is :data:`HEADER` (64 bytes, little-endian,
``struct`` format ``<4sBBBBIIQIIIQIIIQ``)::

    magic  b"OMNR"  | version u8 | type u8 | dtype u8 | flags u8 |
    job u32 | rank u32 | seq u64 | slot u32 | round u32 | count u32 |
    numel u64 | block_size u32 | lanes u32 | slots u32 | watermark u64

The frames after it depend on the type (see :class:`MsgType` and docs/reference/protocol.md). :func:`decode`
turns a header and its frames into one message object (:class:`Bootstrap`, :class:`Contribution`,
:class:`Result`, ...), checking the frame count and every frame's size against the tensor's layout in
one place, so that handlers on both sides receive objects and never index frames. Each message's
:meth:`payload` gives the frames after the header for sending. Decoding never copies block data:
arrays are views of the received frames. Anything wrong raises :class:`WireError`.

The array frames (row vectors, block data) and how they are read are :mod:`omnireduce.wire_data`'s;
its functions are importable from here too (``from omnireduce.wire import to_wire, unwire``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import struct
from typing import Any, NamedTuple

import numpy as np

from omnireduce.blocks import Layout
from omnireduce.dtypes import DType
from omnireduce.errors import WireError
from omnireduce.wire_data import decode_rows as decode_rows
from omnireduce.wire_data import element_frame, frame_buffer, u64_frame
from omnireduce.wire_data import encode_rows as encode_rows
from omnireduce.wire_data import to_wire as to_wire
from omnireduce.wire_data import unwire as unwire
from omnireduce.wire_data import wire_elements as wire_elements

MAGIC = b"OMNR"
VERSION = 2
HEADER = struct.Struct("<4sBBBBIIQIIIQIIIQ")
MAX_LANES = 1 << 16
MAX_SLOTS = 1 << 16
MAX_BLOCK_SIZE = 1 << 20
MAX_NUMEL = 1 << 40
MAX_JSON = 64 * 1024


class MsgType(enum.IntEnum):
    """Message types. w = worker, a = aggregator."""

    HELLO = 1      # w->a  [hdr, json{job, rank, world_size, block_size, token, client, timeout}]
    WELCOME = 2    # a->w  [hdr(job=handle), json{job, handle, world_size, instance}]
    BOOTSTRAP = 3  # w->a  [hdr(seq, slot, numel, dtype, block_size, lanes, slots), rows(lanes), data if EAGER]
    CONTRIB = 4    # w->a  [hdr(seq, slot, round, count, numel, ...), rows(count), data]
    RESULT = 5     # a->w  [hdr(seq, slot, round, count), rows(lanes), data]
    ERROR = 6      # a->w  [hdr(seq, slot, round, flags=ErrorCode), json{code, message}]
    QUERY = 7      # w->a  [hdr(seq)]: what is tensor seq waiting for?
    STATUS = 8     # a->w  [hdr(seq), json{slots: [{slot, round, missing}, ...]}]
    ABORT = 9      # w->a  [hdr(seq), optional json{reason, code}]: drop tensor seq of this job
    GOODBYE = 10   # w->a  [hdr]: this rank leaves the job
    FINAL = 11     # w->a  [hdr(seq, slot, count, numel, ...), ids u64[count], data]: a finished slot's sums
    REPLAY = 12    # a->w  [hdr(seq, slot, count), ids u64[count], data]: a slot's sums, from a FINAL


class ErrorCode(enum.IntEnum):
    BAD_MESSAGE = 1      # undecodable or out-of-range fields
    REFUSED = 2          # token, rank, world size
    UNKNOWN_JOB = 3      # job handle not known (aggregator restarted?)
    MISMATCH = 4         # ranks disagree about a tensor
    PROTOCOL = 5         # a message that is valid but not expected now
    ABORTED = 6          # the tensor was aborted (by a rank or the aggregator)
    REPLACED = 7         # another process took over this rank
    TIMEOUT = 8          # the aggregator gave up waiting for some ranks
    LIMIT = 9            # a resource limit of the aggregator was hit


_MSG_TYPES = {int(t): t for t in MsgType}  # (a dict lookup: the enum's own call is slower, per message)
_DTYPES = {int(d): d for d in DType}

SEQ_ALL = 0xFFFFFFFFFFFFFFFF  # an ERROR about the whole job, not one tensor
FLAG_RETRY = 1  # BOOTSTRAP: this rank is starting the slot again (the aggregator restarted)
#: BOOTSTRAP of a one-round slot (every lane of the tensor holds one row): it carries the rank's blocks
#: too; RESULT of such a slot: its row vector is the lanes summed, not a next instruction (it is final).
FLAG_EAGER = 2


class Header(NamedTuple):
    mtype: MsgType
    dtype: int = 0
    flags: int = 0
    job: int = 0
    rank: int = 0
    seq: int = 0
    slot: int = 0
    round: int = 0
    count: int = 0  # type: ignore[assignment]  # typeshed: shadows tuple.count; the wire field's name
    numel: int = 0
    block_size: int = 0
    lanes: int = 0
    slots: int = 0
    watermark: int = 0  # BOOTSTRAP: tensors < this are complete at the sender; RESULT: ... at every rank

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, int(self.mtype), self.dtype, self.flags, self.job, self.rank,
                           self.seq, self.slot, self.round, self.count, self.numel, self.block_size,
                           self.lanes, self.slots, self.watermark)


def unpack_header(frame: bytes | memoryview) -> Header:
    """Decode and validate frame 0. Raises :class:`WireError` saying what was wrong."""
    if len(frame) != HEADER.size:
        raise WireError(f"header is {len(frame)} bytes, expected {HEADER.size}")
    (magic, version, mtype, dtype, flags, job, rank, seq, slot, rnd, count, numel, block_size,
     lanes, slots, watermark) = HEADER.unpack(frame)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}, expected {MAGIC!r}: not an omnireduce message")
    if version != VERSION:
        raise WireError(f"protocol version {version}, this side speaks {VERSION}")
    mt = _MSG_TYPES.get(mtype)
    if mt is None:
        raise WireError(f"unknown message type {mtype}")
    if numel > MAX_NUMEL or block_size > MAX_BLOCK_SIZE or lanes > MAX_LANES or slots > MAX_SLOTS:
        raise WireError(f"field out of range (numel={numel}, block_size={block_size}, lanes={lanes}, "
                        f"slots={slots})")
    return Header(mt, dtype, flags, job, rank, seq, slot, rnd, count, numel, block_size, lanes, slots, watermark)


def header_dtype(hdr: Header) -> DType:
    """The dtype a header names, or :class:`WireError`."""
    dtype = _DTYPES.get(hdr.dtype)
    if dtype is None:
        raise WireError(f"unknown dtype code {hdr.dtype}")
    return dtype


def tensor_layout(hdr: Header) -> Layout:
    """The layout of the tensor a worker's BOOTSTRAP, CONTRIB or FINAL describes, validated."""
    if hdr.block_size < 1 or hdr.lanes < 1 or hdr.slots < 1 or hdr.slot >= hdr.slots:
        raise WireError(f"bad geometry: block_size={hdr.block_size}, lanes={hdr.lanes}, "
                        f"slots={hdr.slots}, slot={hdr.slot}")
    layout = Layout(hdr.numel, hdr.block_size, hdr.lanes, hdr.slots)
    if layout.rows > (1 << 32) - 2:
        raise WireError("too many rows per lane")
    return layout


def pack_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(frame: Any, what: str) -> dict[str, Any]:
    buf = bytes(frame_buffer(frame))
    if len(buf) > MAX_JSON:
        raise WireError(f"{what}: {len(buf)} bytes of JSON, at most {MAX_JSON}")
    try:
        obj = json.loads(buf)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{what}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise WireError(f"{what}: JSON must be an object, got {type(obj).__name__}")
    return obj


def frame_bytes(frames: list[Any]) -> int:
    """Total payload bytes of a multipart message (for statistics): ``zmq.Frame`` objects, bytes,
    memoryviews or numpy arrays."""
    n = 0
    for f in frames:
        n += f.nbytes if isinstance(f, (memoryview, np.ndarray)) else len(f)
    return n


# -- typed messages ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hello:
    """A rank joins a job (its first message to an aggregator, and again after a reconnect)."""

    header: Header
    job: str
    rank: int
    world_size: int
    block_size: int
    token: str | None
    client: str  # the worker process (a random id): a reconnect from the same one keeps its place
    timeout: float  # the worker's per-tensor deadline, seconds

    def payload(self) -> list[Any]:
        return [pack_json({"job": self.job, "rank": self.rank, "world_size": self.world_size,
                           "block_size": self.block_size, "token": self.token, "client": self.client,
                           "timeout": self.timeout})]


@dataclasses.dataclass(frozen=True)
class Welcome:
    """The aggregator accepted a HELLO: ``header.job`` is the job's handle from now on."""

    header: Header
    job: str
    world_size: int
    instance: str  # random per aggregator process: a new one means the aggregator restarted

    def payload(self) -> list[Any]:
        return [pack_json({"job": self.job, "handle": self.header.job, "world_size": self.world_size,
                           "instance": self.instance})]


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """A rank's first non-zero row in each lane of one slot (INF: none).

    In a one-round slot (``layout.one_round``: every lane holds one row, so every non-zero block
    is summed in the first round) it also carries ``data``, the rank's blocks of the lanes that hold
    a row, in ascending lane order (flag :data:`FLAG_EAGER`): what it would otherwise send as its
    contribution after the first instruction, one round trip earlier."""

    header: Header
    layout: Layout
    rows: np.ndarray  # uint32[lanes]
    data: np.ndarray | None = None  # wire data of the blocks (EAGER), else None

    @property
    def retry(self) -> bool:
        return bool(self.header.flags & FLAG_RETRY)

    def payload(self) -> list[Any]:
        frames = list(encode_rows(self.rows, self.layout.row_width))
        return frames if self.data is None else [*frames, self.data]


@dataclasses.dataclass(frozen=True)
class Contribution:
    """A rank's blocks for one round: one per lane it was instructed to send, and each lane's next row."""

    header: Header
    layout: Layout
    rows: np.ndarray  # uint32[count]: the next non-zero row of each lane sent (INF: none)
    data: np.ndarray  # wire data (storage dtype); its length is checked by the slot, which knows the lanes

    def payload(self) -> list[Any]:
        return [*encode_rows(self.rows, self.layout.row_width), self.data]


@dataclasses.dataclass(frozen=True)
class Result:
    """The sums of one round of one slot, and the next instruction (``cur``; all INF: finished).

    Flag :data:`FLAG_EAGER` (the answer to eager bootstraps, round 1): ``cur`` is the instruction the
    sums answer (the lanes summed, in ascending order), and the slot is finished."""

    header: Header
    layout: Layout
    cur: np.ndarray  # uint32[lanes]
    data: np.ndarray  # wire data (storage dtype) of the previous instruction's live lanes

    @property
    def eager(self) -> bool:
        return bool(self.header.flags & FLAG_EAGER)

    def payload(self) -> list[Any]:
        return [*encode_rows(self.cur, self.layout.row_width), self.data]


@dataclasses.dataclass(frozen=True)
class SlotSums:
    """FINAL (a rank's sums of a slot it finished, for ranks that lost them) or REPLAY (those sums,
    sent on by the aggregator): block ids and their data, the short block trimmed."""

    header: Header
    layout: Layout
    ids: np.ndarray  # int64[count], unique, all within the slot
    data: np.ndarray

    def payload(self) -> list[Any]:
        return [self.ids.astype("<u8", copy=False), self.data]


@dataclasses.dataclass(frozen=True)
class Error:
    """Something went wrong; ``header.seq`` names the tensor, or :data:`SEQ_ALL` the whole job.
    ``cause``: for ``ABORTED`` about a tensor aborted earlier, the code it was aborted with (e.g.
    ``MISMATCH``), so that a rank that comes late learns why without reading ``message``."""

    header: Header
    code: ErrorCode
    message: str
    cause: ErrorCode | None = None

    def payload(self) -> list[Any]:
        info = {"code": self.code.name, "message": self.message}
        if self.cause is not None:
            info["cause"] = self.cause.name
        return [pack_json(info)]


@dataclasses.dataclass(frozen=True)
class Status:
    """What the aggregator is waiting for on tensor ``header.seq`` (the answer to a QUERY)."""

    header: Header
    info: dict[str, Any]

    def payload(self) -> list[Any]:
        return [pack_json(self.info)]


@dataclasses.dataclass(frozen=True)
class Abort:
    """A rank gives up on tensor ``header.seq``; ``timeout``: because its deadline passed."""

    header: Header
    reason: str = ""
    timeout: bool = False

    def payload(self) -> list[Any]:
        return [pack_json({"reason": self.reason[:1000], "code": "TIMEOUT" if self.timeout else "ABORTED"})]


@dataclasses.dataclass(frozen=True)
class Bare:
    """A message that is its header alone: QUERY (what is tensor ``seq`` waiting for?) and GOODBYE."""

    header: Header

    def payload(self) -> list[Any]:
        return []


Message = Hello | Welcome | Bootstrap | Contribution | Result | SlotSums | Error | Status | Abort | Bare


def encode(msg: Message) -> list[Any]:
    """All frames of ``msg``, header first."""
    return [msg.header.pack(), *msg.payload()]


def decode(hdr: Header, frames: list[Any], layout: Layout | None = None,
           dtype: DType | None = None) -> Message:
    """The message ``hdr`` and the frames after it make, checked; :class:`WireError` otherwise.

    ``layout`` and ``dtype`` are those of the tensor the message is about, where it carries rows or
    block data; by default they are what the header describes (a worker's BOOTSTRAP, CONTRIB and FINAL
    carry the whole geometry). A worker passes its own for RESULT and REPLAY, whose headers do not.
    """
    lo, hi = _FRAMES[hdr.mtype]
    if not lo <= len(frames) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise WireError(f"{hdr.mtype.name}: {len(frames)} frames after the header, expected {want}")
    what = hdr.mtype.name
    if hdr.mtype in _JSON_ONLY:
        return _decode_json(hdr, frames)
    if hdr.mtype in (MsgType.QUERY, MsgType.GOODBYE):
        return Bare(hdr)
    lay = layout if layout is not None else tensor_layout(hdr)
    storage = (dtype if dtype is not None else header_dtype(hdr)).storage
    if hdr.mtype is MsgType.BOOTSTRAP:
        eager = bool(hdr.flags & FLAG_EAGER)
        if eager != lay.one_round or len(frames) != 2 + eager:
            raise WireError(f"{what}: {len(frames)} frames after the header, flags {hdr.flags}: a tensor of "
                            f"{lay.rows} row(s) per lane sends its blocks with the bootstrap "
                            f"{'(flag EAGER, 3 frames)' if lay.one_round else 'never (2 frames, no flag EAGER)'}")
        rows = decode_rows(frames[0], frames[1], lay.lanes, lay.row_width, f"{what} rows")
        return Bootstrap(hdr, lay, rows, element_frame(frames[2], storage, f"{what} block data") if eager else None)
    if hdr.mtype is MsgType.CONTRIB:
        rows = decode_rows(frames[0], frames[1], hdr.count, lay.row_width, f"{what} next rows")
        return Contribution(hdr, lay, rows, element_frame(frames[2], storage, f"{what} block data"))
    if hdr.mtype is MsgType.RESULT:
        cur = decode_rows(frames[0], frames[1], lay.lanes, lay.row_width, f"{what} instruction")
        return Result(hdr, lay, cur, element_frame(frames[2], storage, f"{what} block data"))
    # FINAL / REPLAY
    ids = u64_frame(frames[0], hdr.count, f"{what} block ids")
    if ids.size and (int(ids.max()) >= lay.num_blocks
                     or np.any((ids % lay.total_lanes) // lay.lanes != hdr.slot)
                     or np.unique(ids).size != ids.size):
        raise WireError(f"{what}: block ids past the tensor, outside slot {hdr.slot}, or repeated")
    ids = ids.astype(np.int64)
    data = element_frame(frames[1], storage, f"{what} data",
                     exactly=wire_elements(lay, ids.size, lay.short_index(ids) is not None))
    return SlotSums(hdr, lay, ids, data)


def _decode_json(hdr: Header, frames: list[Any]) -> Message:
    what = hdr.mtype.name
    try:
        info = unpack_json(frames[0], what) if frames else {}
    except WireError:
        if hdr.mtype is not MsgType.ERROR:
            raise
        info = {}  # an error is never dropped: its code (in the header) is enough to act on
    try:
        if hdr.mtype is MsgType.HELLO:
            token = info.get("token")
            return Hello(hdr, job=str(info["job"])[:256], rank=int(info["rank"]),
                         world_size=int(info["world_size"]), block_size=int(info.get("block_size", 0)),
                         token=token if isinstance(token, str) else None if token is None else "",
                         client=str(info.get("client", ""))[:64],
                         timeout=min(3600.0, max(0.1, float(info.get("timeout", 60.0)))))
        if hdr.mtype is MsgType.WELCOME:
            return Welcome(hdr, job=str(info.get("job", "")), world_size=int(info.get("world_size", 0)),
                           instance=str(info.get("instance", "")))
        if hdr.mtype is MsgType.ERROR:
            try:
                code = ErrorCode(hdr.flags)
            except ValueError:
                code = ErrorCode.PROTOCOL
            cause = ErrorCode.__members__.get(str(info.get("cause")))  # (absent: an older aggregator)
            return Error(hdr, code, str(info.get("message", code.name)), cause)
        if hdr.mtype is MsgType.STATUS:
            return Status(hdr, info)
        return Abort(hdr, reason=str(info.get("reason", ""))[:1000], timeout=info.get("code") == "TIMEOUT")
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"{what} is missing or has a bad field: {e}") from None


_JSON_ONLY = frozenset({MsgType.HELLO, MsgType.WELCOME, MsgType.ERROR, MsgType.STATUS, MsgType.ABORT})
_FRAMES: dict[MsgType, tuple[int, int]] = {
    MsgType.HELLO: (1, 1), MsgType.WELCOME: (1, 1), MsgType.BOOTSTRAP: (2, 3), MsgType.CONTRIB: (3, 3),
    MsgType.RESULT: (3, 3), MsgType.ERROR: (0, 1), MsgType.QUERY: (0, 0), MsgType.STATUS: (1, 1),
    MsgType.ABORT: (0, 1), MsgType.GOODBYE: (0, 0), MsgType.FINAL: (2, 2), MsgType.REPLAY: (2, 2),
}
