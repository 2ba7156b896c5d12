"""Unit tests: header packing, row encoding, short-block trimming, and typed messages (decode/encode)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnireduce.blocks import INF, Layout
from omnireduce.dtypes import DType
from omnireduce.errors import WireError
from omnireduce.wire import (
    FLAG_EAGER,
    HEADER,
    MAGIC,
    VERSION,
    Abort,
    Bare,
    Bootstrap,
    Contribution,
    Error,
    ErrorCode,
    Header,
    Hello,
    MsgType,
    Result,
    SlotSums,
    Status,
    Welcome,
    decode,
    decode_rows,
    encode,
    encode_rows,
    to_wire,
    unpack_header,
    unpack_json,
    unwire,
    wire_elements,
)

u32 = st.integers(0, 2**32 - 1)
headers = st.builds(Header, st.sampled_from(list(MsgType)), st.integers(0, 255), st.integers(0, 255), u32, u32,
                    st.integers(0, 2**64 - 1), u32, u32, u32, st.integers(0, 2**40), st.integers(0, 2**20),
                    st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**64 - 1))


@given(headers)
def test_header_round_trip(h: Header) -> None:
    packed = h.pack()
    assert len(packed) == HEADER.size == 64
    assert unpack_header(packed) == h
    assert unpack_header(memoryview(packed)) == h


def _raw(**over: int | bytes) -> bytes:
    fields = dict(magic=MAGIC, version=VERSION, mtype=int(MsgType.RESULT), dtype=1, flags=0, job=1, rank=0,
                  seq=0, slot=0, round=0, count=0, numel=10, block_size=256, lanes=1, slots=1, watermark=0)
    fields.update(over)
    return HEADER.pack(*fields.values())


@pytest.mark.parametrize("frame,match", [
    (b"", "0 bytes"),
    (_raw()[:-1], "63 bytes"),
    (_raw() + b"x", "65 bytes"),
    (_raw(magic=b"HTTP"), "bad magic"),
    (_raw(version=VERSION + 1), "protocol version"),
    (_raw(mtype=0), "unknown message type"),
    (_raw(mtype=99), "unknown message type"),
    (_raw(numel=2**41), "out of range"),
    (_raw(block_size=2**21), "out of range"),
    (_raw(lanes=2**16 + 1), "out of range"),
])
def test_bad_headers_are_rejected(frame: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        unpack_header(frame)


def test_header_layout_is_the_documented_one() -> None:
    """docs/reference/protocol.md: 64 bytes, ``struct`` format ``<4sBBBBIIQIIIQIIIQ``, these fields at these offsets."""
    assert HEADER.format == "<4sBBBBIIQIIIQIIIQ" and HEADER.size == 64
    h = Header(MsgType.CONTRIB, dtype=2, flags=3, job=0x04040404, rank=0x05050505, seq=0x0606060606060606,
               slot=0x07070707, round=0x08080808, count=0x09090909, numel=0x0A0A0A0A0A, block_size=0x0B0B0B,
               lanes=0x0C0C, slots=0x0D0D, watermark=0x0E0E0E0E0E0E0E0E)
    b = h.pack()
    assert b[0:4] == b"OMNR" and b[4] == VERSION == 2 and b[5] == int(MsgType.CONTRIB) and b[6] == 2 and b[7] == 3
    for offset, size, value in ((8, 4, h.job), (12, 4, h.rank), (16, 8, h.seq), (24, 4, h.slot), (28, 4, h.round),
                                (32, 4, h.count), (36, 8, h.numel), (44, 4, h.block_size), (48, 4, h.lanes),
                                (52, 4, h.slots), (56, 8, h.watermark)):
        assert int.from_bytes(b[offset: offset + size], "little") == value, offset


def _some(bits: int, limit: int) -> st.SearchStrategy[int]:
    """Integers of ``bits`` bits, often near ``limit`` (a field's largest valid value)."""
    return st.one_of(st.integers(0, 2**bits - 1), st.integers(max(0, limit - 2), min(2**bits - 1, limit + 2)))


# 64-byte frames with the right magic and version: only the later checks can reject them
magic_headers = st.one_of(
    st.binary(min_size=HEADER.size - 5, max_size=HEADER.size - 5).map(lambda rest: MAGIC + bytes([VERSION]) + rest),
    st.builds(lambda mtype, *fields: HEADER.pack(MAGIC, VERSION, mtype, *fields),
              st.one_of(st.sampled_from([int(m) for m in MsgType]), st.integers(0, 255)), st.integers(0, 255),
              st.integers(0, 255), u32, u32, st.integers(0, 2**64 - 1), u32, u32, u32, _some(64, 2**40),
              _some(32, 2**20), _some(32, 2**16), _some(32, 2**16), st.integers(0, 2**64 - 1)))


@given(magic_headers)
def test_headers_with_the_right_magic_decode_exactly_or_say_why_not(frame: bytes) -> None:
    _, _, mtype, *_, numel, block_size, lanes, slots, _ = HEADER.unpack(frame)
    known = mtype in {int(m) for m in MsgType}
    in_range = numel <= 2**40 and block_size <= 2**20 and lanes <= 65536 and slots <= 65536
    if known and in_range:
        assert unpack_header(frame).pack() == frame
        return
    with pytest.raises(WireError, match="unknown message type" if not known else "out of range"):
        unpack_header(frame)


@given(st.binary(max_size=80))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    with contextlib.suppress(WireError):
        unpack_header(frame)


def test_json_frames() -> None:
    assert unpack_json(b'{"a": 1}', "x") == {"a": 1}
    for bad, match in ((b"\xff", "not valid JSON"), (b"[1]", "must be an object"), (b"{" * 70000, "at most")):
        with pytest.raises(WireError, match=match):
            unpack_json(bad, "x")


@given(st.lists(st.one_of(st.just(INF), st.integers(0, 300)), max_size=70), st.sampled_from([1, 2, 4]))
def test_row_encoding_round_trips(rows: list[int], width: int) -> None:
    r = np.array(rows, dtype=np.uint32)
    if width == 1:
        r = np.where(r == INF, INF, r % 256).astype(np.uint32)
    bitmap, packed = encode_rows(r, width)
    assert np.array_equal(decode_rows(bitmap, packed.view(np.uint8), r.size, width, "x"), r)
    zeros = np.where(r == INF, INF, 0).astype(np.uint32)
    bitmap, packed = encode_rows(zeros, 0)
    assert packed.size == 0 and np.array_equal(decode_rows(bitmap, packed, r.size, 0, "x"), zeros)


def test_row_decoding_rejects_bad_frames() -> None:
    bitmap, packed = encode_rows(np.array([1, INF, 3], dtype=np.uint32), 2)
    with pytest.raises(WireError, match="bitmap"):
        decode_rows(bitmap, packed.view(np.uint8), 9, 2, "x")
    with pytest.raises(WireError, match="rows"):
        decode_rows(bitmap, packed.view(np.uint8)[:-1], 3, 2, "x")
    with pytest.raises(WireError, match="past entry"):
        decode_rows(np.array([0xFF], np.uint8), np.zeros(6, np.uint8), 3, 2, "x")


def test_wire_padding_helpers() -> None:
    blocks = np.arange(12, dtype=np.float32).reshape(3, 4)
    wire = to_wire(blocks, 1, 2)
    assert wire.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    back = unwire(wire, 3, 4, 1, 2)
    assert back.tolist() == [[0, 1, 2, 3], [4, 5, 0, 0], [8, 9, 10, 11]]
    lay = Layout(10, 4, lanes=2, slots=2)
    assert wire_elements(lay, 3, True) == 10 and wire_elements(lay, 3, False) == 12


def _round_trip(msg, layout=None, dtype=None):  # type: ignore[no-untyped-def]
    """Encode ``msg`` to bytes frames (as they come off a socket) and decode them again."""
    frames = [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(msg)]
    return decode(unpack_header(frames[0]), frames[1:], layout, dtype)


def result_of(lay: Layout) -> Result:
    return Result(Header(MsgType.RESULT), lay, np.zeros(lay.lanes, np.uint32), np.zeros(0, np.float32))


def test_every_message_type_round_trips() -> None:
    lay = Layout(1000, 64, lanes=4, slots=2)  # 16 blocks, 2 rows per lane: rows travel as 1 byte
    tensor = dict(dtype=int(DType.FLOAT32), numel=1000, block_size=64, lanes=4, slots=2)
    rows = np.array([0, INF, 1, 0], np.uint32)
    data = np.arange(2 * 64, dtype=np.float32)
    hello = Hello(Header(MsgType.HELLO, rank=1), "job", 1, 4, 256, "secret", "c1", 30.0)
    assert _round_trip(hello) == hello
    welcome = Welcome(Header(MsgType.WELCOME, job=7), "job", 4, "abc")
    assert _round_trip(welcome) == welcome
    boot = _round_trip(Bootstrap(Header(MsgType.BOOTSTRAP, slot=1, **tensor), lay, rows))
    assert isinstance(boot, Bootstrap) and boot.layout == lay and np.array_equal(boot.rows, rows) and not boot.retry
    one = Layout(1000, 64, lanes=8, slots=2)  # 16 blocks, one row per lane: blocks travel with the bootstrap
    one_tensor = {**tensor, "lanes": 8}
    eager_rows = np.array([0, INF, 0, INF, INF, INF, INF, 0], np.uint32)
    blocks = np.arange(3 * 64, dtype=np.float32)
    eager = _round_trip(Bootstrap(Header(MsgType.BOOTSTRAP, flags=FLAG_EAGER, count=3, **one_tensor), one,
                                  eager_rows, blocks))
    assert isinstance(eager, Bootstrap) and np.array_equal(eager.rows, eager_rows)
    assert eager.data is not None and np.array_equal(eager.data, blocks) and boot.data is None
    eager_result = _round_trip(Result(Header(MsgType.RESULT, dtype=int(DType.FLOAT32), flags=FLAG_EAGER, round=1,
                                             count=3), one, eager_rows, blocks), one)
    assert isinstance(eager_result, Result) and eager_result.eager and not result_of(lay).eager
    nxt = np.array([1, INF], np.uint32)
    contrib = _round_trip(Contribution(Header(MsgType.CONTRIB, slot=1, round=1, count=2, **tensor), lay, nxt, data))
    assert isinstance(contrib, Contribution) and np.array_equal(contrib.rows, nxt)
    assert np.array_equal(contrib.data, data)
    result = _round_trip(Result(Header(MsgType.RESULT, dtype=int(DType.FLOAT32), slot=1, round=1, count=2), lay,
                                rows, data), lay)
    assert isinstance(result, Result) and np.array_equal(result.cur, rows) and np.array_equal(result.data, data)
    ids = np.array([4, 13], np.int64)  # lane 0 and 1 of slot 1 (lanes 4..7 of 8), rows 0 and 1
    sums = _round_trip(SlotSums(Header(MsgType.FINAL, slot=1, count=2, **tensor), lay, ids, data))
    assert isinstance(sums, SlotSums) and sums.ids.dtype == np.int64 and np.array_equal(sums.ids, ids)
    err = Error(Header(MsgType.ERROR, flags=int(ErrorCode.MISMATCH), seq=3), ErrorCode.MISMATCH, "ranks differ")
    assert _round_trip(err) == err
    status = Status(Header(MsgType.STATUS, seq=3), {"slots": [], "members": [0, 1]})
    assert _round_trip(status) == status
    abort = Abort(Header(MsgType.ABORT, seq=3), "late", timeout=True)
    assert _round_trip(abort) == abort
    for mtype in (MsgType.QUERY, MsgType.GOODBYE):
        assert _round_trip(Bare(Header(mtype, seq=3))) == Bare(Header(mtype, seq=3))


def test_decode_checks_frame_counts_and_sizes_in_one_place() -> None:
    tensor = dict(dtype=int(DType.FLOAT16), numel=1000, block_size=64, lanes=4, slots=2)
    lay = Layout(1000, 64, lanes=4, slots=2)
    bitmap, packed = encode_rows(np.zeros(4, np.uint32), lay.row_width)
    cases = [
        (Header(MsgType.HELLO), [], "0 frames after the header, expected 1"),
        (Header(MsgType.QUERY), [b"x"], "expected 0"),
        (Header(MsgType.ABORT), [b"{}", b"{}"], "expected 0 to 1"),
        (Header(MsgType.HELLO), [b'{"job": "j"}'], "missing or has a bad field"),
        (Header(MsgType.BOOTSTRAP, slot=2, **tensor), [bitmap, packed], "bad geometry"),
        (Header(MsgType.BOOTSTRAP, **{**tensor, "dtype": 99}), [bitmap, packed], "unknown dtype"),
        (Header(MsgType.BOOTSTRAP, **tensor), [b"", packed], "bitmap"),
        (Header(MsgType.CONTRIB, count=0, **tensor), [b"", b"", b"abc"], "whole number of float16"),
        # a tensor of several rows per lane never sends blocks with its bootstrap, one of one row always does
        (Header(MsgType.BOOTSTRAP, flags=FLAG_EAGER, **tensor), [bitmap, packed, b""], "never"),
        (Header(MsgType.BOOTSTRAP, **tensor), [bitmap, packed, b""], "never"),
        (Header(MsgType.BOOTSTRAP, **{**tensor, "lanes": 8}), [np.zeros(1, np.uint8), b""], "EAGER, 3 frames"),
        (Header(MsgType.BOOTSTRAP, flags=FLAG_EAGER, **{**tensor, "lanes": 8}), [np.zeros(1, np.uint8), b""],
         "EAGER, 3 frames"),
        (Header(MsgType.BOOTSTRAP, flags=FLAG_EAGER, **{**tensor, "lanes": 8}), [np.zeros(1, np.uint8), b"", b"abc"],
         "whole number of float16"),
        (Header(MsgType.FINAL, slot=1, count=1, **tensor), [np.array([0], "<u8"), np.zeros(64, np.float16)],
         "outside slot 1"),
        (Header(MsgType.FINAL, count=2, **tensor), [np.array([0, 0], "<u8"), np.zeros(128, np.float16)],
         "repeated"),
        # block 15 (lane 7: slot 1) is the short one, 1000 - 15 * 64 = 40 elements
        (Header(MsgType.FINAL, slot=1, count=1, **tensor), [np.array([15], "<u8"), np.zeros(64, np.float16)],
         "expected 80 "),
    ]
    for hdr, frames, match in cases:
        with pytest.raises(WireError, match=match):
            decode(hdr, frames)
    ok = decode(Header(MsgType.FINAL, count=1, **tensor), [np.array([0], "<u8"), np.zeros(64, np.float16)])
    assert isinstance(ok, SlotSums) and ok.ids.tolist() == [0] and ok.data.dtype == np.float16
    short = decode(Header(MsgType.FINAL, slot=1, count=1, **tensor), [np.array([15], "<u8"), np.zeros(40, np.float16)])
    assert isinstance(short, SlotSums) and short.data.size == 40


def test_an_error_with_unreadable_json_still_arrives() -> None:
    err = decode(Header(MsgType.ERROR, flags=int(ErrorCode.TIMEOUT)), [b"\xff"])
    assert isinstance(err, Error) and err.code is ErrorCode.TIMEOUT and err.message == "TIMEOUT"
    unknown = decode(Header(MsgType.ERROR, flags=200), [])
    assert isinstance(unknown, Error) and unknown.code is ErrorCode.PROTOCOL
