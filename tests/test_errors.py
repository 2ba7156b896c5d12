"""Errors and deadlines: every failure is a clear exception, on every rank, within its deadline."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

import omnireduce
from omnireduce.wire import Header, MsgType
from tests.harness import Case, RankPool, assert_matches, run_in_threads


def test_first_contact_times_out_against_a_silent_aggregator() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(omnireduce.OmniReduceTimeout, match=rf"tcp://127.0.0.1:{port}.*within 1 s"):
        omnireduce.Worker([f"tcp://127.0.0.1:{port}"], rank=0, world_size=2, job="j", timeout=1.0)
    assert time.monotonic() - t0 < 4
    silent.close(0)


def test_tensor_timeout_names_the_missing_rank(aggregator, job: str) -> None:
    with omnireduce.Worker([aggregator.address], rank=0, world_size=3, job=job, timeout=1.5) as w:
        x = np.ones(1000, np.float32)
        t0 = time.monotonic()
        with pytest.raises(omnireduce.OmniReduceTimeout) as err:
            w.allreduce(x)
        assert time.monotonic() - t0 < 1.5 + 2
    msg = str(err.value)
    assert f"job {job!r}" in msg and "tensor 0" in msg and "slot 0 round 0" in msg
    assert aggregator.address in msg and "waiting for ranks [1, 2]" in msg
    assert np.all(x == 1), "a failed reduction must leave its input untouched"


def test_tensor_timeout_when_the_aggregator_dies(job: str) -> None:
    agg = omnireduce.Aggregator().start()
    timeout = 1.0
    with omnireduce.Worker([agg.address], rank=0, world_size=2, job=job, timeout=timeout) as w:
        agg.stop()
        t0 = time.monotonic()
        with pytest.raises(omnireduce.OmniReduceTimeout, match="did not answer"):
            w.allreduce(np.ones(10, np.float32))
        # within its deadline: the timeout, plus the grace period of the QUERY nobody answers
        assert time.monotonic() - t0 < timeout + 2


def test_mismatched_tensors_fail_on_every_rank(pool: RankPool, aggregator, job: str) -> None:
    cases = {0: [Case(1000, seed=1), Case(500, dtype="float16"), Case(64, seed=3)],
             1: [Case(1200, seed=1), Case(500, dtype="float32"), Case(64, seed=3)]}
    outs = pool.run([aggregator.address], 2, cases, job=job)
    for out in outs:
        first, second, third = out["results"]
        assert first[0] == "error" and first[1] == "OmniReduceMismatchError"
        assert "element count: rank 0 has 1000, rank 1 has 1200" in first[2] or \
               "element count: rank 1 has 1200, rank 0 has 1000" in first[2]
        assert second[0] == "error" and second[1] == "OmniReduceMismatchError"
        assert "dtype" in second[2] and "float16" in second[2], second[2]
        assert third[0] == "ok", "later tensors of the job still work"
        assert_matches(Case(64, seed=3), 2, third[1])


def test_mismatched_block_size_fails_on_every_rank(pool: RankPool, aggregator, job: str) -> None:
    outs = pool.run([aggregator.address], 2, [Case(4096)], job=job, per_rank={1: {"block_size": 128}}, timeout=60)
    for out in outs:
        (status, kind, msg, _when), = out["results"]
        assert status == "error" and kind == "OmniReduceMismatchError" and "block size" in msg, msg


def test_world_size_mismatch_is_refused(aggregator, job: str) -> None:
    with omnireduce.Worker([aggregator.address], rank=0, world_size=2, job=job, timeout=5), \
            pytest.raises(omnireduce.OmniReduceMismatchError, match="world size 3 but the job has 2"):
        omnireduce.Worker([aggregator.address], rank=1, world_size=3, job=job, timeout=5)


def test_bad_inputs_are_rejected_at_the_call(aggregator, job: str) -> None:
    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=5) as w:
        with pytest.raises(TypeError, match="float64"):
            w.allreduce(np.ones(3))
        with pytest.raises(TypeError, match="list"):
            w.allreduce([1.0, 2.0])
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            w.allreduce(ro)
        # the worker is still fine, and a world of one is the identity
        x = np.arange(5, dtype=np.float32)
        assert np.array_equal(w.allreduce(x), np.arange(5, dtype=np.float32))


@pytest.mark.torch
def test_bad_torch_inputs_are_rejected_at_the_call(aggregator, job: str) -> None:
    import torch

    with omnireduce.Worker([aggregator.address], rank=0, world_size=1, job=job, timeout=5) as w:
        with pytest.raises(TypeError, match="int32"):
            w.allreduce(torch.ones(3, dtype=torch.int32))
        with pytest.raises(TypeError, match="sparse"):
            w.allreduce(torch.ones(3).to_sparse())
        x = torch.arange(5, dtype=torch.float32)
        assert torch.equal(w.allreduce(x), torch.arange(5, dtype=torch.float32))


def test_bad_configuration_is_explained() -> None:
    with pytest.raises(ValueError, match="OMNIREDUCE_AGGREGATORS"):
        omnireduce.Worker(None, rank=0, world_size=1)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        omnireduce.Worker(["localhost:5555"], rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 3 is not within world size 2"):
        omnireduce.Worker(["tcp://127.0.0.1:1"], rank=3, world_size=2)
    with pytest.raises(ValueError, match="block_size"):
        omnireduce.Worker(["tcp://127.0.0.1:1"], rank=0, world_size=1, block_size=0)


def test_token_is_checked(job: str) -> None:
    with omnireduce.Aggregator(token="s3cret") as agg:
        with omnireduce.Worker([agg.address], rank=0, world_size=1, job=job, token="s3cret", timeout=5) as w:
            assert w.allreduce(np.ones(4, np.float32)).tolist() == [1, 1, 1, 1]
        for token, word in ((None, "missing"), ("wrong", "wrong")):
            with pytest.raises(omnireduce.OmniReduceRefused, match=f"{word} token"):
                omnireduce.Worker([agg.address], rank=0, world_size=1, job=job + "x", token=token, timeout=5)


def test_public_address_needs_a_token() -> None:
    with pytest.raises(ValueError, match="without a token"):
        omnireduce.Aggregator("tcp://0.0.0.0:0")
    agg = omnireduce.Aggregator("tcp://0.0.0.0:0", insecure=True)
    agg.start()
    agg.stop()


def test_garbage_gets_error_replies_and_the_aggregator_keeps_serving(aggregator, job: str) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(aggregator.address)
    bad = [[b"hello"], [b"HTTP" + bytes(60)], [Header(MsgType.RESULT).pack()],
           [Header(MsgType.BOOTSTRAP, job=12345).pack(), b"", b""], [Header(MsgType.HELLO).pack(), b"not json"]]
    for frames in bad:
        s.send_multipart(frames)
    replies = []
    while s.poll(1000):
        replies.append(s.recv_multipart())
    assert len(replies) == len(bad)
    texts = b" ".join(r[1] for r in replies).decode()
    for needle in ("expected 64", "bad magic", "RESULT is not sent", "unknown job handle", "not valid JSON"):
        assert needle in texts
    s.close(0)
    # a real job still works

    def rank(r: int) -> np.ndarray:
        with omnireduce.Worker([aggregator.address], rank=r, world_size=2, job=job, timeout=10) as w:
            return w.allreduce(np.full(300, r + 1.0, np.float32))

    done = run_in_threads(rank, 2, timeout=30)
    assert len(done) == 2 and all(np.all(d == 3.0) for d in done)


def test_token_from_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path, job: str) -> None:
    (tmp_path / "token").write_text("from-a-file\n")
    monkeypatch.delenv("OMNIREDUCE_TOKEN", raising=False)
    monkeypatch.setenv("OMNIREDUCE_TOKEN_FILE", str(tmp_path / "token"))
    with omnireduce.Aggregator(token="from-a-file") as agg, \
            omnireduce.Worker([agg.address], rank=0, world_size=1, job=job, timeout=5) as w:
        assert w.config.token == "from-a-file"
    monkeypatch.setenv("OMNIREDUCE_TOKEN_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="cannot read OMNIREDUCE_TOKEN_FILE"):
        omnireduce.Worker(["tcp://127.0.0.1:1"], rank=0, world_size=1)
