"""omnireduce.distributed inside the test pool's rank processes (see tests/test_distributed.py).

Each function runs in every rank on a real Gloo process group of its own, calls
``omnireduce.distributed`` as a program written for ``torch.distributed.all_reduce`` would, and returns
what it saw (values, bits, errors) for the test to judge against references made independently: the
float64 sums of tests/harness.py, and torch's own all_reduce run on the same inputs in the same ranks.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import omnireduce.distributed as odist
from tests.ddp_cases import process_group
from tests.harness import Case, make_input, to_bits, to_numpy


def _inputs(case: Case, rank: int) -> torch.Tensor:
    x = make_input(case, rank)
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def sums(rank: int, world_size: int, port: int, cases: list[Case], average: bool,
         env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per case: omnireduce's result twice (values, bits), torch's all_reduce of the same input (SUM; for
    AVG its sum divided by the world size in float64), and the reducer's counters at the end."""
    out: list[dict[str, Any]] = []
    with process_group(rank, world_size, port):
        op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
        for case in cases:
            x = _inputs(case, rank)
            ours, again, theirs = x.clone(), x.clone(), x.clone()
            odist.all_reduce(ours, op=op)
            work = odist.all_reduce(again, op=op, async_op=True)
            work.wait()
            dist.all_reduce(theirs)
            want = to_numpy(theirs) / world_size if average else to_numpy(theirs)
            out.append({"values": to_numpy(ours), "bits": to_bits(ours), "again": to_bits(again), "torch": want,
                        "shape": tuple(ours.shape), "dtype": str(ours.dtype)})
        out.append({"stats": odist.stats()})
        odist.shutdown()
    return out


def _checked(name: str, check: Callable[[], Any], results: list[tuple[str, bool, str]]) -> None:
    try:
        detail = check()
        results.append((name, True, str(detail or "")))
    except BaseException as e:
        results.append((name, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


def _filled(size: int, value: Any, dtype: torch.dtype = torch.float) -> torch.Tensor:
    """A cube of side ``size`` filled with ``value`` (the shape torch's all_reduce tests use)."""
    return torch.empty(size, size, size, dtype=dtype).fill_(value)


def _sum_each_source(group: list[int], group_id: Any, rank: int, op: Any, mine: Any, other: Any, want: Any,
                     dtype: torch.dtype = torch.float, async_op: bool = False) -> str:
    """torch's pattern: for each source rank of the group, the source gives ``mine`` and the others
    ``other``; every rank must then hold ``want`` in a tensor of side source + 1."""
    for src in group:
        t = _filled(src + 1, mine if rank == src else other, dtype)
        work = odist.all_reduce(t, op, group_id, async_op=async_op)
        if async_op:
            assert isinstance(work, dist.Work), type(work)
            assert work.wait() is True and work.is_completed()
            got = work.get_future().value()
            assert isinstance(got, list) and len(got) == 1 and got[0] is t, got
        else:
            assert work is None, work
        expected = _filled(src + 1, want, dtype)
        assert torch.equal(t, expected), f"source {src}: {t.reshape(-1)[:4]} != {expected.reshape(-1)[:4]}"
    return f"{len(group)} sources"


def torch_expectations(rank: int, world_size: int, port: int) -> list[tuple[str, bool, str]]:
    """torch's all_reduce expectations, each as a named check (a port of what torch's own tests ask of
    ``all_reduce``: results of SUM/PRODUCT/MIN/MAX on the world, a subgroup and a full new group, async
    handles, complex tensors, coalesced calls, sparse tensors, ranks outside a group)."""
    results: list[tuple[str, bool, str]] = []
    W = world_size
    with process_group(rank, world_size, port):
        world = list(range(W))
        sub_ranks = [1, 2] if W >= 3 else [0, 1]
        sub = dist.new_group(sub_ranks)
        full = dist.new_group()
        S, P, MIN, MAX = dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX
        r = rank

        def on(group: list[int], gid: Any, *args: Any, **kw: Any) -> str:
            return _sum_each_source(group, gid, r, *args, **kw) if r in group else "not a member"

        _checked("sum", lambda: on(world, None, S, 2, 10, 2 + 10 * (W - 1)), results)
        _checked("sum async", lambda: on(world, None, S, 2, 10, 2 + 10 * (W - 1), async_op=True), results)
        _checked("sum bfloat16", lambda: on(world, None, S, 2, 10, 2 + 10 * (W - 1), torch.bfloat16), results)
        _checked("avg", lambda: on(world, None, dist.ReduceOp.AVG, 2, 10, (2 + 10 * (W - 1)) / W), results)
        _checked("product", lambda: on(world, None, P, 2, 10, 2 * 10 ** (W - 1)), results)
        _checked("min", lambda: on(world, None, MIN, 1010, 1, 1), results)
        _checked("max", lambda: on(world, None, MAX, -1, 10, 10), results)
        _checked("int64 sum", lambda: on(world, None, S, 2, 10, 2 + 10 * (W - 1), torch.int64), results)
        _checked("complex sum", lambda: on(world, None, S, complex(2, 3), complex(10, 11),
                                           complex(2, 3) + complex(10, 11) * (W - 1), torch.cfloat), results)
        _checked("group sum", lambda: on(sub_ranks, sub, S, 2, 10, 2 + 10 * (len(sub_ranks) - 1)), results)
        _checked("group sum async", lambda: on(sub_ranks, sub, S, 2, 10, 2 + 10 * (len(sub_ranks) - 1),
                                               async_op=True), results)
        _checked("group max", lambda: on(sub_ranks, sub, MAX, -1, 10, 10), results)
        _checked("full group sum", lambda: on(world, full, S, 2, 10, 2 + 10 * (W - 1)), results)
        _checked("full group min", lambda: on(world, full, MIN, 1010, 1, 1), results)
        _checked("complex unsupported ops", lambda: _complex_unsupported(), results)
        _checked("not a member", lambda: _not_a_member(r, sub_ranks, sub), results)
        _checked("coalesced sum", lambda: _coalesced(r, W), results)
        _checked("coalesced with complex", lambda: _coalesced_complex(r, W), results)
        _checked("sparse sum", lambda: _sparse(r, W), results)
        _checked("in flight together", lambda: _in_flight(r, W), results)
        _checked("leaf that requires grad, non-contiguous", lambda: _leaf_and_strided(r, W), results)
        _checked("in torch.distributed.all_reduce's place", lambda: _in_torchs_place(r, W), results)
        odist.shutdown()
    return results


def _complex_unsupported() -> str:
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND,
               dist.ReduceOp.BOR, dist.ReduceOp.BXOR):
        try:
            odist.all_reduce(_filled(1, 1, torch.cfloat), op)
        except ValueError as e:
            assert "all_reduce does not support" in str(e), e
            continue
        raise AssertionError(f"{op} on a complex tensor did not raise ValueError")
    return "ValueError for each"


def _not_a_member(rank: int, members: list[int], group: Any) -> str:
    t = torch.ones(3) * (rank + 1)
    if rank in members:
        return "a member"
    assert odist.all_reduce(t, group=group) is None and odist.all_reduce(t, group=group, async_op=True) is None
    assert torch.equal(t, torch.ones(3) * (rank + 1)), t
    return "None, tensor untouched"


def _coalesced(rank: int, W: int) -> str:
    tensors = [_filled(2, 2 if rank == 0 else 10), torch.full((5,), float(rank)), torch.zeros(7)]
    assert odist.all_reduce_coalesced(tensors) is None
    assert torch.equal(tensors[0], _filled(2, 2 + 10 * (W - 1)))
    assert torch.equal(tensors[1], torch.full((5,), float(sum(range(W))))) and not tensors[2].any()
    more = [torch.full((3,), float(rank + 1)), torch.full((4,), 2.0)]
    fut = odist.all_reduce_coalesced(more, dist.ReduceOp.AVG, async_op=True)
    assert isinstance(fut, torch.futures.Future), type(fut)
    got = fut.wait()
    assert got[0] is more[0] and got[1] is more[1]
    assert torch.allclose(more[0], torch.full((3,), sum(range(1, W + 1)) / W)) and torch.equal(more[1], more[1] * 0 + 2)
    return "sync and async"


def _coalesced_complex(rank: int, W: int) -> str:
    values = [2, 3, complex(2, 3)] if rank == 0 else [10, 11, complex(10, 11)]
    dtypes = [torch.float, torch.float, torch.cfloat]
    tensors = [_filled(2, v, d) for v, d in zip(values, dtypes, strict=True)]
    odist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM)
    want = [2 + 10 * (W - 1), 3 + 11 * (W - 1), complex(2, 3) + complex(10, 11) * (W - 1)]
    for t, w, d in zip(tensors, want, dtypes, strict=True):
        assert torch.equal(t, _filled(2, w, d)), (t.reshape(-1)[:2], w)
    return "as torch"


def _sparse(rank: int, W: int) -> str:
    """Each rank's rows 0..rank with values rank+1 (plus a duplicate of row 0): the sum, coalesced, in the
    tensor itself; the future's value is that tensor."""
    idx = torch.tensor([[0, *range(rank + 1)]])
    vals = torch.full((rank + 2, 3), float(rank + 1))
    s = torch.sparse_coo_tensor(idx, vals, (W + 1, 3))
    mirror = s.clone()
    work = odist.all_reduce(s, async_op=True)
    assert work.wait() and work.get_future().value()[0] is s
    dist.all_reduce(mirror)
    assert s.is_sparse and s.is_coalesced(), s
    assert torch.equal(s._indices(), mirror._indices()), (s._indices(), mirror._indices())
    assert torch.equal(s._values(), mirror._values()), (s._values(), mirror._values())
    return f"{s._nnz()} rows, as torch's Gloo all-reduce leaves them"


def _in_flight(rank: int, W: int) -> str:
    xs = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(5)]
    works = [odist.all_reduce(x, async_op=True) for x in xs]
    for i, w in reversed(list(enumerate(works))):
        w.wait()
        assert torch.equal(xs[i], torch.full_like(xs[i], float(sum(range(W)) + W * i))), i
    return "5 calls"


def _leaf_and_strided(rank: int, W: int) -> str:
    leaf = torch.full((300,), float(rank), requires_grad=True)
    odist.all_reduce(leaf)
    assert leaf.requires_grad and leaf.grad_fn is None
    assert torch.equal(leaf.detach(), torch.full((300,), 1.0 * sum(range(W))))
    base = torch.arange(600, dtype=torch.float32).reshape(20, 30) * (rank + 1)
    view = base.t()
    odist.all_reduce(view)
    want = torch.arange(600, dtype=torch.float32).reshape(20, 30).t() * sum(range(1, W + 1))
    assert torch.equal(view, want) and torch.equal(base, want.t())
    return "in place"


def _in_torchs_place(rank: int, W: int) -> str:
    """A program that puts omnireduce's call in torch's place: its calls go through omnireduce, and the
    engine's own all-reduces (a small tensor is reduced whole by the backend's) still through torch's."""
    saved = dist.all_reduce
    dist.all_reduce = odist.all_reduce
    try:
        small, large = torch.full((100,), float(rank)), torch.full((1 << 18,), float(rank))
        dist.all_reduce(small)
        dist.all_reduce(large, op=dist.ReduceOp.AVG)
    finally:
        dist.all_reduce = saved
    assert torch.equal(small, torch.full((100,), float(sum(range(W)))))
    assert torch.allclose(large, torch.full((1 << 18,), sum(range(W)) / W))
    return "both"


def mismatch(rank: int, world_size: int, port: int, env: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """Calls the ranks disagree about (the last rank differs), each followed by one they agree on; per
    call, what this rank got: ``("ok", values)`` or ``(error type, message)``."""
    last = rank == world_size - 1
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("numel", lambda: odist.all_reduce(torch.ones(10 + int(last)))),
        ("shape", lambda: odist.all_reduce(torch.ones((2, 6) if last else (3, 4)))),
        ("dtype", lambda: odist.all_reduce(torch.ones(8, dtype=torch.bfloat16 if last else torch.float32))),
        ("op", lambda: odist.all_reduce(torch.ones(8), op=dist.ReduceOp.AVG if last else dist.ReduceOp.SUM)),
        ("async", lambda: odist.all_reduce(torch.ones(9 + int(last)), async_op=True).wait()),
        ("coalesced", lambda: odist.all_reduce_coalesced([torch.ones(4)] * (2 + int(last)))),
        ("sparse rows", lambda: odist.all_reduce(torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 4),
                                                                       (5 + int(last), 4)))),
    ]
    out = []
    with process_group(rank, world_size, port):
        for name, fn in calls:
            try:
                fn()
                out.append((name, "ok"))
            except Exception as e:
                out.append((name, f"{type(e).__name__}: {e}"))
            agreed = torch.full((6,), float(rank))
            odist.all_reduce(agreed)  # the group goes on
            out.append((f"after {name}", "ok" if torch.equal(agreed, torch.full((6,), float(sum(range(world_size)))))
                        else f"wrong: {agreed}"))
        odist.shutdown()
    return out


def subgroups(rank: int, world_size: int, port: int) -> dict[str, Any]:
    """Groups of some ranks used in turn (overlapping, so that the ranks hold different numbers of groups
    when each is first used), and a DeviceMesh's dimensions; per group, its sum."""
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    with process_group(rank, world_size, port):
        pairs = {name: dist.new_group(ranks) for name, ranks in (("01", [0, 1]), ("12", [1, 2]), ("23", [2, 3]))}
        for name, g in pairs.items():
            members = [int(c) for c in name]
            if rank in members:
                t = torch.full((513,), float(rank + 1))
                odist.all_reduce(t, group=g)
                out[name] = float(t[0])
        x = torch.full((1000,), float(rank + 1))
        odist.all_reduce(x)
        out["world"] = float(x[0])
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for dim in ("dp", "tp"):
            t = torch.full((700,), float(rank + 1))
            work = odist.all_reduce(t, group=mesh.get_group(dim), async_op=True)
            work.wait()
            out[dim] = (float(t[0]), dist.get_process_group_ranks(mesh.get_group(dim)))
        odist.shutdown()
    return out
