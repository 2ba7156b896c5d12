"""Unit tests: header packing and the rejection of malformed headers."""

from __future__ import annotations

import contextlib
import struct

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


@given(st.binary(max_size=80))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    with contextlib.suppress(WireError):
        unpack_header(frame)


def test_json_frames() -> None:
    assert unpack_json(b'{"a": 1}', "x") == {"a": 1}
    for bad, match in ((b"\xff", "not valid JSON"), (b"[1]", "must be an object"), (b"{" * 70000, "at most")):
        with pytest.raises(WireError, match=match):
            unpack_json(bad, "x")
    assert struct.calcsize("<4sBBBBIIQIIIQIIIQ") == 64
