"""How lean a host bucket's exchange can be: a hand-written one for a single case (W=2, float32, whole
256-element blocks, one fused all-gather of the bitmap and every block), against the engine as it
is, taking turns repeat by repeat in one process group:

- ``lean_sync``: the hand-written exchange on the caller's thread;
- ``lean``: the same through the engine's thread (it stands in for the engine's exchange);
- ``numpy``: the engine with ``OMNIREDUCE_ENGINE_KERNELS=1`` (numpy's kernel exchange);
- ``torch``: the engine as it is by default (the torch ops);
- ``unit``: a 1-element all-reduce; ``dense``: the bucket's all-reduce.

Every engine result must equal the hand-written one's bits. Prints the slowest rank's medians.
Usage: python lean_floor.py [--port 29631] > lean_floor.txt"""

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B = 256
CASES = [(1 << 16, 0.0, "gather", 300), (1 << 22, 0.01, "auto", 80)]  # (elements, density, exchange, repeats)


def lean(flat: torch.Tensor, group, rank: int, bufs: dict) -> None:
    """The bucket summed in place over 2 ranks: one all-to-all of each rank's bitmap and blocks."""
    w = flat.numpy().reshape(-1, B)
    nb = w.shape[0]
    nbytes = -(-nb // 8)
    head = -(-nbytes // 16) * 16
    flags = (np.bitwise_or.reduce(w.view(np.uint64), axis=1) & np.uint64(0x7FFFFFFF7FFFFFFF)) != 0
    ids = np.flatnonzero(flags)
    rec = head + 2 * max(ids.size, 4) * B * 4
    if bufs.get("rec", 0) < rec:
        bufs.update(rec=rec, send=torch.empty(rec, dtype=torch.uint8), recv=torch.empty(rec, dtype=torch.uint8))
    send, recv = bufs["send"][:rec], bufs["recv"][:rec]
    sn, rn = send.numpy(), recv.numpy()
    sn[:nbytes] = np.packbits(flags)
    mine = sn[head: head + ids.size * B * 4].view(np.float32).reshape(-1, B)
    np.take(w, ids, axis=0, out=mine)
    splits = [0 if q == rank else rec for q in range(2)]
    dist.all_to_all_single(recv, send, splits, splits, group=group)
    other = np.unpackbits(rn[:nbytes], count=nb).view(bool)
    oid = np.flatnonzero(other)
    rows = rn[head: head + oid.size * B * 4].view(np.float32).reshape(-1, B)
    w[np.flatnonzero(flags | other)] = -0.0
    for i, r in ([(ids, mine), (oid, rows)] if rank == 0 else [(oid, rows), (ids, mine)]):  # (rank order)
        if i.size:
            w[i] += r


def main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from omnireduce.engines import collective, exchange_device

    own = exchange_device.reduce
    state = {"lean": False}
    bufs: dict = {}
    group = dist.new_group(backend="gloo")

    def through_engine(flat, block_size, **kw):  # the engine's exchange, or the hand-written one
        if not state["lean"]:
            return own(flat, block_size, **kw)
        lean(flat, kw["group"], rank, bufs)
        c = exchange_device.Counts((1, 1), 1, False)
        return exchange_device.Outcome(exchange_device.Exchange.GATHER, c, False, False, 0, 0, 1, 1)

    collective.exchange_device.reduce = through_engine
    def engine(ex: str) -> collective.CollectiveEngine:
        return collective.CollectiveEngine(group, block_size=B, lanes=1, slots=1,
                                           **({} if ex == "auto" else {"exchange": ex}))

    engines = {ex: engine(ex) for ex in ("auto", "gather")}
    leans = {ex: engine(ex) for ex in ("auto", "gather")}  # (their own history: the lean way's counts are not real)
    one = torch.ones(1)
    for n, density, ex, repeats in CASES:
        nb = n // B
        rng = np.random.default_rng(rank)
        x = torch.zeros(n)
        keep = np.array([7]) if density == 0 else rng.choice(nb, max(1, int(nb * density)), replace=False)
        x.view(nb, B)[torch.from_numpy(keep)] = torch.from_numpy(rng.standard_normal((keep.size, B)).astype(np.float32))
        want = x.clone()
        lean(want, group, rank, bufs)
        times = {k: [] for k in ("lean_sync", "lean", "numpy", "torch", "unit", "dense")}
        for i in range(repeats + 5):
            for way in times:
                state["lean"] = way == "lean"
                os.environ["OMNIREDUCE_ENGINE_KERNELS"] = "1" if way == "numpy" else "0"  # (lean: the torch ops' seam)
                t = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                if way == "unit":
                    dist.all_reduce(one)
                elif way == "dense":
                    dist.all_reduce(t)
                elif way == "lean_sync":
                    lean(t, group, rank, bufs)
                else:
                    (leans if way == "lean" else engines)[ex].allreduce_async(t).wait()
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= 5:
                    times[way].append(float(dt))
                if way not in ("unit", "dense"):
                    assert torch.equal(t.view(torch.int32), want.view(torch.int32)), way
        if rank == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            name = "one block" if density == 0 else f"{density:g}"
            print(f"n={n} d={name} {ex} ({repeats} repeats): " + ", ".join(
                f"{k} {v:.3f} ms ({v / med['unit']:.1f} units, {v / med['dense']:.3f}x dense)" for k, v in med.items()),
                flush=True)
    for e in [*engines.values(), *leans.values()]:
        e.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=29631)
    mp.spawn(main, args=(p.parse_args().port,), nprocs=2)
