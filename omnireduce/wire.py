"""The wire format: one fixed, versioned header frame followed by raw array frames.

Every message is a zmq multipart message. Frame 0 is :data:`HEADER` (64 bytes, little-endian,
``struct`` format ``<4sBBBBIIQIIIQIIIQ``)::

    magic  b"OMNR"  | version u8 | type u8 | dtype u8 | flags u8 |
    job u32 | rank u32 | seq u64 | slot u32 | round u32 | count u32 |
    numel u64 | block_size u32 | lanes u32 | slots u32 | watermark u64

The frames after it depend on the type (see :class:`MsgType` and docs/protocol.md). ``rows(n)`` is
a vector of ``n`` block rows sent as two frames: a bitmap (one bit per entry, least significant bit
first) of the entries that hold a row, and those rows packed little-endian at the width the tensor's
layout needs (0 bytes when every lane has a single row). Block data is raw elements of the
tensor's dtype.
Decoding validates sizes and value ranges before anything is used and raises :class:`WireError`.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any, NamedTuple

import numpy as np

from omnireduce.blocks import Layout, decode_rows
from omnireduce.errors import WireError

MAGIC = b"OMNR"
VERSION = 1
HEADER = struct.Struct("<4sBBBBIIQIIIQIIIQ")
MAX_LANES = 1 << 16
MAX_SLOTS = 1 << 16
MAX_BLOCK_SIZE = 1 << 20
MAX_NUMEL = 1 << 40
MAX_JSON = 64 * 1024


class MsgType(enum.IntEnum):
    """Message types. w = worker, a = aggregator."""

    HELLO = 1      # w->a  [hdr, json{job, rank, world_size, block_size, token, client}]
    WELCOME = 2    # a->w  [hdr(job=handle), json{...}]
    BOOTSTRAP = 3  # w->a  [hdr(seq, slot, numel, dtype, block_size, lanes, slots), rows(lanes)]
    CONTRIB = 4    # w->a  [hdr(seq, slot, round, count), rows(count), data]
    RESULT = 5     # a->w  [hdr(seq, slot, round, count), rows(lanes), data]
    ERROR = 6      # a->w  [hdr(seq, slot, round, flags=ErrorCode), json{code, message, ...}]
    QUERY = 7      # w->a  [hdr(seq)]: what is tensor seq waiting for?
    STATUS = 8     # a->w  [hdr(seq), json{slots: [{slot, round, missing}, ...]}]
    ABORT = 9      # w->a  [hdr(seq)]: drop tensor seq of this job
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


SEQ_ALL = 0xFFFFFFFFFFFFFFFF  # an ERROR about the whole job, not one tensor
FLAG_RETRY = 1  # BOOTSTRAP: this rank is starting the slot again (the aggregator restarted)


class Header(NamedTuple):
    mtype: MsgType
    dtype: int = 0
    flags: int = 0
    job: int = 0
    rank: int = 0
    seq: int = 0
    slot: int = 0
    round: int = 0
    count: int = 0
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
    try:
        mt = MsgType(mtype)
    except ValueError:
        raise WireError(f"unknown message type {mtype}") from None
    if numel > MAX_NUMEL or block_size > MAX_BLOCK_SIZE or lanes > MAX_LANES or slots > MAX_SLOTS:
        raise WireError(f"field out of range (numel={numel}, block_size={block_size}, lanes={lanes}, "
                        f"slots={slots})")
    return Header(mt, dtype, flags, job, rank, seq, slot, rnd, count, numel, block_size, lanes, slots, watermark)


def u64_array(frame: Any, count: int, what: str) -> np.ndarray:
    """Frame as ``count`` little-endian uint64 (zero-copy), or :class:`WireError`."""
    dt = np.dtype("<u8")
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    if buf.nbytes != dt.itemsize * count:
        raise WireError(f"{what}: frame of {buf.nbytes} bytes, expected {dt.itemsize * count} ({count} x {dt})")
    return np.frombuffer(buf, dtype=dt)


def decode_row_frames(bitmap: Any, packed: Any, n: int, width: int, what: str) -> np.ndarray:
    """Rows sent as a bitmap frame and a packed-rows frame (see :func:`omnireduce.blocks.encode_rows`)."""
    b = np.frombuffer(memoryview(bitmap.buffer if hasattr(bitmap, "buffer") else bitmap), dtype=np.uint8)
    p = np.frombuffer(memoryview(packed.buffer if hasattr(packed, "buffer") else packed), dtype=np.uint8)
    try:
        return decode_rows(b, p, n, width, what)
    except ValueError as e:
        raise WireError(str(e)) from None


def data_array(frame: Any, storage: np.dtype, elements: int, what: str) -> np.ndarray:
    """Frame as ``elements`` values of ``storage`` (zero-copy), or :class:`WireError`."""
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame)
    if buf.nbytes != elements * storage.itemsize:
        raise WireError(f"{what}: frame of {buf.nbytes} bytes, expected {elements * storage.itemsize} "
                        f"({elements} x {storage})")
    return np.frombuffer(buf, dtype=storage)


def decode_slot_sums(ids_frame: Any, data_frame: Any, count: int, layout: Layout, slot: int,
                     storage: np.dtype, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The payload of a FINAL or REPLAY: slot ``slot``'s summed block ids (int64) and their data
    (the short last block trimmed), zero-copy, or :class:`WireError` if an id is past the tensor,
    outside the slot or repeated, or the data does not match the ids."""
    ids = u64_array(ids_frame, count, f"{what} block ids")
    if ids.size and (int(ids.max()) >= layout.num_blocks
                     or np.any((ids % layout.total_lanes) // layout.lanes != slot)
                     or np.unique(ids).size != ids.size):
        raise WireError(f"{what}: block ids past the tensor, outside slot {slot}, or repeated")
    has_short = bool(layout.tail) and bool(ids.size) and int(ids.max()) == layout.num_blocks - 1
    data = data_array(data_frame, storage, layout.wire_elements(ids.size, has_short), f"{what} data")
    return ids.astype(np.int64), data


def pack_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(frame: Any, what: str) -> dict[str, Any]:
    buf = bytes(frame.buffer if hasattr(frame, "buffer") else frame)
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
    """Total payload bytes of a multipart message (for statistics)."""
    total = 0
    for f in frames:
        total += memoryview(f.buffer if hasattr(f, "buffer") else f).nbytes
    return total
