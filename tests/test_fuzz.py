"""Hostile input: >20,000 random, truncated and mutated messages against a live aggregator process,
interleaved with real all-reduces that must stay exact. Afterwards the aggregator still serves and
its memory (RSS) stayed within a bound: at most 48 MiB above what it used after the warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import omnireduce
from omnireduce.blocks import encode_rows
from omnireduce.wire import HEADER, MAGIC, VERSION, Header, MsgType
from tests.harness import Case, RankPool

AGG = str(Path(sys.executable).with_name("omnireduce-agg"))
RSS_BOUND = 48 << 20


def _hello(job: str, rank: int, world: int = 2) -> list[bytes]:
    return [Header(MsgType.HELLO, rank=rank).pack(),
            json.dumps({"job": job, "rank": rank, "world_size": world, "block_size": 256}).encode()]


def _templates(handle: int, rank: int) -> list[list[bytes]]:
    """Valid messages of every kind for the fuzzer's own job (so mutations reach deep code)."""
    rows = np.where(np.arange(64) % 3 == 0, 0, 0xFFFFFFFF).astype(np.uint32)
    bitmap, packed = encode_rows(rows, 0)
    meta = dict(dtype=1, job=handle, rank=rank, numel=64 * 256, block_size=256, lanes=64, slots=1)
    data = np.ones(22 * 256, np.float32).tobytes()
    return [
        [Header(MsgType.BOOTSTRAP, seq=5, **meta).pack(), bitmap.tobytes(), packed.tobytes()],
        [Header(MsgType.CONTRIB, seq=5, round=1, count=22, **meta).pack(), np.zeros(3, np.uint8).tobytes(), b"",
         data],
        [Header(MsgType.FINAL, seq=6, count=2, **meta).pack(), np.array([0, 3], "<u8").tobytes(),
         np.ones(512, np.float32).tobytes()],
        [Header(MsgType.QUERY, seq=5, **meta).pack()],
        [Header(MsgType.ABORT, seq=7, **meta).pack(), b'{"reason": "x"}'],
        _hello("fuzz", rank),
    ]


def _mutate(rng: np.random.Generator, msg: list[bytes]) -> list[bytes]:
    frames = [bytearray(f) for f in msg]
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(0, 8))
        f = int(rng.integers(0, len(frames)))
        if kind == 0 and frames[f]:  # flip bytes
            for _ in range(int(rng.integers(1, 8))):
                frames[f][int(rng.integers(0, len(frames[f])))] = int(rng.integers(0, 256))
        elif kind == 1:  # truncate
            frames[f] = frames[f][: int(rng.integers(0, len(frames[f]) + 1))]
        elif kind == 2:  # extend
            frames[f] += rng.bytes(int(rng.integers(1, 64)))
        elif kind == 3 and len(frames) > 1:  # drop a frame
            frames.pop(f)
        elif kind == 4:  # duplicate a frame
            frames.insert(f, frames[f])
        elif kind == 5:  # a header field set to something extreme
            hdr = bytearray(frames[0].ljust(HEADER.size, b"\0")[: HEADER.size])
            offset = int(rng.choice([6, 7, 8, 12, 16, 24, 28, 32, 36, 44, 48, 52, 56]))
            hdr[offset: offset + 4] = int(rng.choice([0, 1, 2**31 - 1, 2**32 - 1, 65536, 65537])).to_bytes(4, "little")
            frames[0] = hdr
        elif kind == 6:  # another message type in a valid header
            hdr = bytearray(frames[0].ljust(HEADER.size, b"\0")[: HEADER.size])
            hdr[5] = int(rng.integers(0, 16))
            frames[0] = hdr
        else:  # random garbage frame
            frames[f] = bytearray(rng.bytes(int(rng.integers(0, 200))))
    return [bytes(f) for f in frames]


def _drain(socks: list[zmq.Socket]) -> int:
    n = 0
    for s in socks:
        while True:
            try:
                s.recv_multipart(zmq.NOBLOCK)
                n += 1
            except zmq.Again:
                break
    return n


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([AGG, "--listen", "tcp://127.0.0.1:0", "--log-level", "ERROR", *args],
                         stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().split()[-1]


def test_fuzz_twenty_thousand_messages_while_real_reductions_stay_exact(pool: RankPool, job: str) -> None:
    agg, address = _start("--max-jobs", "64", "--max-job-bytes", str(32 << 20), "--max-slots-per-job", "256")
    proc = psutil.Process(agg.pid)
    ctx = zmq.Context()
    try:
        warm = pool.run([address], 2, [Case(300_000, density=0.3, seed=s) for s in range(5)], job=job + "-warm")
        assert all(r[0] == "ok" for o in warm for r in o["results"])
        rss0 = proc.memory_info().rss
        cases = [Case(int(n), density=d, seed=100 + i, dtype=t) for i, (n, d, t) in
                 enumerate([(200_000, 0.1, "float32"), (77_777, 1.0, "float16"), (500_000, 0.02, "bfloat16")] * 10)]
        handle = pool.submit([address], 2, cases, job=job, timeout=60.0, verify=True)
        # the fuzzer: five connections; two of them join a job of their own so that mutated
        # messages reach the bootstrap/contribution/final handlers past the membership checks
        socks = []
        for _ in range(5):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            socks.append(s)
        templates = []
        for rank, s in enumerate(socks[:2]):
            s.send_multipart(_hello("fuzz", rank))
            assert s.poll(5000)
            welcome = s.recv_multipart()
            templates += _templates(int.from_bytes(welcome[0][8:12], "little"), rank)
        rng = np.random.default_rng(2026)
        sent = 0
        t0 = time.monotonic()
        while sent < 21_000:
            s = socks[sent % len(socks)]
            if sent % 10 == 0:
                msg = [rng.bytes(int(rng.integers(0, 100))) for _ in range(int(rng.integers(1, 5)))]
            else:
                msg = _mutate(rng, templates[int(rng.integers(0, len(templates)))])
            s.send_multipart(msg)
            sent += 1
            if sent % 500 == 0:
                _drain(socks)
        _drain(socks)
        outs = pool.collect(handle, timeout=300)
        for out in outs:
            for case, (status, *rest) in zip(cases, out["results"], strict=True):
                assert status == "ok", (case, rest)
        # still alive and serving; memory within the bound
        assert agg.poll() is None
        with omnireduce.Worker([address], rank=0, world_size=1, job=job + "-after", timeout=10) as w:
            assert w.allreduce(np.full(1000, 3.0, np.float32)).sum() == 3000
        rss1 = proc.memory_info().rss
        assert rss1 - rss0 < RSS_BOUND, f"RSS grew by {(rss1 - rss0) >> 20} MiB (from {rss0 >> 20} MiB)"
        assert time.monotonic() - t0 < 120
    finally:
        ctx.destroy(0)
        agg.terminate()
        agg.wait()


messages = st.lists(st.one_of(
    st.binary(max_size=80),
    st.builds(lambda t, d, f, c, n, L, S, seq: Header(MsgType(t), dtype=d, flags=f, count=c, numel=n, lanes=L,
                                                      slots=S, seq=seq).pack(),
              st.sampled_from([int(m) for m in MsgType]), st.integers(0, 255), st.integers(0, 255),
              st.integers(0, 2**32 - 1), st.integers(0, 2**40), st.integers(0, 2**16), st.integers(0, 2**16),
              st.integers(0, 2**64 - 1)),
    st.just(MAGIC + bytes([VERSION]))), min_size=1, max_size=5)


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages)
def test_hypothesis_messages_never_break_the_aggregator(frames: list[bytes]) -> None:
    sock = _shared["sock"]
    sock.send_multipart(frames)
    _drain([sock])


_shared: dict = {}


def setup_module() -> None:
    agg = omnireduce.Aggregator().start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(agg.address)
    _shared.update(agg=agg, ctx=ctx, sock=sock)


def teardown_module() -> None:
    agg = _shared["agg"]
    try:
        with omnireduce.Worker([agg.address], rank=0, world_size=1, job="after-hypothesis", timeout=10) as w:
            assert w.allreduce(np.ones(10, np.float32)).sum() == 10  # it survived every example
    finally:
        _shared["ctx"].destroy(0)
        agg.stop()
