"""Unit tests: header packing and the rejection of malformed headers."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnireduce.errors import WireError
from omnireduce.wire import HEADER, MAGIC, VERSION, Header, MsgType, unpack_header, unpack_json

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
    """docs/protocol.md: 64 bytes, ``struct`` format ``<4sBBBBIIQIIIQIIIQ``, these fields at these offsets."""
    assert HEADER.format == "<4sBBBBIIQIIIQIIIQ" and HEADER.size == 64
    h = Header(MsgType.CONTRIB, dtype=2, flags=3, job=0x04040404, rank=0x05050505, seq=0x0606060606060606,
               slot=0x07070707, round=0x08080808, count=0x09090909, numel=0x0A0A0A0A0A, block_size=0x0B0B0B,
               lanes=0x0C0C, slots=0x0D0D, watermark=0x0E0E0E0E0E0E0E0E)
    b = h.pack()
    assert b[0:4] == b"OMNR" and b[4] == 1 and b[5] == int(MsgType.CONTRIB) and b[6] == 2 and b[7] == 3
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
