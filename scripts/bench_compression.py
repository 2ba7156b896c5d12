#!/usr/bin/env python3
"""Gradient compression on dense models: block top-k with error feedback against torch's hooks.

Three models, 4 ranks on Gloo (CPU, loopback), fixed seeds, the same steps for every method:

* ``lstm``: the word-level LSTM language model of pytorch/examples (word_language_model: embedding 200,
  2 LSTM layers of 200, tied decoder), SGD lr 20 with gradient clipping 0.25 as there (``--lstm-momentum``:
  momentum SGD instead);
* ``gpt2``: a GPT-2-shaped transformer (transformers' ``GPT2Config(n_layer=2, n_embd=128, n_head=4)``,
  random init, no dropout), Adam lr 1e-3, on the same text;
* ``recsys``: the recommender of examples/train_recsys.py (1M embedding rows, Adam lr 1e-3, synthetic clicks).

Methods: ``dense`` (torch's ``allreduce_hook``: what DDP does by default), ``bf16`` (torch's
``bf16_compress_hook``, reimplemented here: torch's refuses to register on CPU), ``powersgd1``/``powersgd4``
(torch's PowerSGD, rank 1 and 4, error feedback, warm start; each bucket finished before the next starts),
``ours0.1``/``ours0.01``/``ours0.001`` (``OmniReduceState(compression=..., path="dense", engine="collective")``:
the compacted blocks on the process group's all-reduce, no aggregator; block size 256, shared selection;
``ours0.01s``: the stale selection); ``omni`` (``OmniReduceState()``: exact omnireduce, its default path
choice, colocated aggregators) and ``omni0.01`` and the like (``OmniReduceState(compression=BlockTopK(density=0.01))``:
compressed where a bucket is dense, exact where it is already sparse, each bucket's way measured; ``omnix0.01``:
the same through the aggregators only, so that no bucket goes uncompressed).
PowerSGD and ours start compressing after the same ``--warmup`` dense steps.

Reported per run: validation loss (and perplexity for the language models) after training, bytes per step
and rank (every tensor handed to ``dist.all_reduce`` is counted; a ring all-reduce sends ``2 (W-1) / W`` of
it, which is what the table shows), and the median step time on loopback.

Text: wikitext-2 (word level, ``<eos>`` per line, the ``--vocab`` most frequent words, others ``<unk>``).
The default is scripts/data/wikitext2-large (418K words to train on, 37K held out: all of wikitext-2's
test split and most of its validation split, see its README); 800 steps read it about twice, and dense
training barely overfits. scripts/data/wikitext2 is a smaller slice (150K words: 800 steps are five
passes, dense training overfits, and a slower compressed run can look as good on the validation loss:
results on it before 2026-11-27 say so). For the full training split, clone
https://github.com/pytorch/examples and pass ``--data word_language_model/data/wikitext-2``.

    python scripts/bench_compression.py                       # everything (~1 hour on 2 cores)
    python scripts/bench_compression.py --models gpt2 --methods dense,ours0.01 --steps 50
    python scripts/bench_compression.py --models lstm --methods dense,ours0.01r100 --seeds 0,1,2   # seed spread
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from seed_spread import against_dense, over_seeds  # (scripts/: this script's folder)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["dense", "bf16", "powersgd1", "powersgd4", "ours0.1", "ours0.01", "ours0.001"]
MODELS = ["lstm", "gpt2", "recsys"]


def load_corpus(data: Path, vocab: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and validation token ids (int64) and the vocabulary size."""
    def words(name: str) -> list[str]:
        return [w for line in (data / name).read_text(encoding="utf-8").splitlines() for w in [*line.split(), "<eos>"]]

    train, valid = words("train.txt"), words("valid.txt")
    common = [w for w, _ in collections.Counter(train).most_common(vocab - 1)]
    ids = {w: i + 1 for i, w in enumerate(common)}  # 0 is <unk>
    return (torch.tensor([ids.get(w, 0) for w in train]), torch.tensor([ids.get(w, 0) for w in valid]),
            len(common) + 1)


class LSTMModel(nn.Module):
    """pytorch/examples word_language_model's RNNModel (LSTM, tied weights), without dropout."""

    def __init__(self, ntoken: int, ninp: int = 200, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, ninp, nlayers, batch_first=True)
        self.decoder = nn.Linear(ninp, ntoken)
        self.decoder.weight = self.encoder.weight
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.rnn(self.encoder(x))[0])


def _recsys_module() -> Any:
    spec = importlib.util.spec_from_file_location("train_recsys", ROOT / "examples" / "train_recsys.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(model: str, ntoken: int) -> tuple[nn.Module, Any]:
    """The model and a loss function ``(model, batch) -> loss``."""
    if model == "lstm":
        m = LSTMModel(ntoken)
        ce = nn.CrossEntropyLoss()
        return m, lambda net, b: ce(net(b[0]).reshape(-1, ntoken), b[1].reshape(-1))
    if model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=ntoken, bos_token_id=None, eos_token_id=None, n_positions=64, n_embd=128,
                         n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), lambda net, b: net(input_ids=b[0], labels=b[0]).loss
    rec = _recsys_module()
    bce = nn.BCEWithLogitsLoss()
    return rec.Recommender(), lambda net, b: bce(net(b[0], b[1]), b[2])


def batches(model: str, tokens: torch.Tensor, rank: int, step: int, args: argparse.Namespace) -> tuple:
    """One rank's batch of a step (random windows of the text, or the recommender's synthetic clicks)."""
    if model == "recsys":
        return _recsys_module_cached().make_batch(rank, step, args.recsys_batch, 1.2)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 10_007 + step)
    start = torch.randint(0, tokens.numel() - args.bptt - 1, (args.batch,), generator=g)
    span = start[:, None] + torch.arange(args.bptt + 1)
    seq = tokens[span]
    return seq[:, :-1], seq[:, 1:]


_REC: list[Any] = []


def _recsys_module_cached() -> Any:
    if not _REC:
        _REC.append(_recsys_module())
    return _REC[0]


def bf16_hook(process_group, bucket):  # (no annotations: DDP checks them, and they are strings here)
    """torch's ``bf16_compress_hook``, which refuses to register without CUDA and NCCL, line for line:
    cast the bucket to bfloat16, divide, all-reduce (Gloo sums bfloat16), copy back."""
    buf = bucket.buffer()
    compressed = buf.to(torch.bfloat16).div_(dist.get_world_size(process_group))
    fut = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0]))


def powersgd_serialized(state, bucket):  # (no annotations: DDP checks them, and they are strings here)
    """torch's PowerSGD hook, finished before the next bucket's starts: it issues its second all-reduce from
    a future's callback, which on Gloo can interleave with the next bucket's first one in a different order
    on each rank (a collective mismatch: runs hung here). Costs it the overlap of its buckets."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    fut = powerSGD_hook.powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def topk(spec: str, warmup: int) -> Any:
    """``BlockTopK`` of a method's spec: the density, then ``s`` (selection="stale"), ``bN`` (block size N,
    default 256), ``rN`` (a density ramp of N steps from 0.25), ``mN`` (min_blocks N): "0.01", "0.01s",
    "0.01b64", "0.01r100m64"."""
    import re

    from omnireduce.compression import BlockTopK

    m = re.fullmatch(r"([0-9.]+)(s?)(?:b(\d+))?(?:r(\d+))?(?:m(\d+))?", spec)
    if m is None:
        raise ValueError(f"bench_compression: bad method spec {spec!r}")
    floor = {"min_blocks": int(m[5])} if m[5] else {}  # (without mN: BlockTopK's default)
    return BlockTopK(density=float(m[1]), block_size=int(m[3] or 256), warmup_steps=warmup,
                     selection="stale" if m[2] else "shared", ramp_steps=int(m[4] or 0), **floor)


def register(ddp: DistributedDataParallel, method: str, warmup: int) -> Any:
    """Register the method's hook; return our state (for its stats) or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if method == "dense":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    elif method == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif method.startswith("powersgd"):
        st = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=int(method[8:]),
                                         start_powerSGD_iter=max(2, warmup), random_seed=0)
        ddp.register_comm_hook(st, powersgd_serialized)
    elif method.startswith("omni"):
        from omnireduce.ddp import OmniReduceState, omnireduce_hook

        # "omni": exact omnireduce; "omni0.01": OmniReduceState(compression=BlockTopK(density=0.01)), each way
        # measured; "omnix0.01": the same with path="omnireduce" (compressed buckets never go uncompressed)
        forced = method.startswith("omnix")
        spec = method[5:] if forced else method[4:]
        st = OmniReduceState(compression=topk(spec, warmup) if spec else None, path="omnireduce" if forced else None)
        ddp.register_comm_hook(st, omnireduce_hook)
        return st
    else:
        from omnireduce.ddp import OmniReduceState, omnireduce_hook

        # "ours0.01": the compacted blocks always on the process group's all-reduce, no aggregator
        st = OmniReduceState(compression=topk(method[4:], warmup), path="dense", engine="collective",
                             hierarchical=False)
        ddp.register_comm_hook(st, omnireduce_hook)
        return st
    return None


def count_allreduce() -> list[int]:
    """Count the bytes of every tensor handed to ``dist.all_reduce`` in this process (hooks call it by name)."""
    counter = [0]
    real = dist.all_reduce

    def counting(tensor: torch.Tensor, *a: Any, **kw: Any) -> Any:
        counter[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *a, **kw)

    dist.all_reduce = counting
    return counter


def sent_so_far(state: Any, omni: bool, counter: list[int], ring: float) -> float:
    """Bytes handed to all-reduce so far (an OmniReduceState's: what it sent, in all-reduce's units)."""
    return state.recorder.counters.snapshot()["bytes_sent"] / ring if omni else counter[0]


def evaluate(model: str, net: nn.Module, loss_fn: Any, valid: torch.Tensor, args: argparse.Namespace) -> float:
    net.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        if model == "recsys":
            for i in range(4):
                total += loss_fn(net, _recsys_module_cached().make_batch(10_000 + i, 0, 1024, 1.2)).item()
                n += 1
        else:
            v = valid[: (min(valid.numel() - 1, args.val_tokens) // args.bptt) * args.bptt + 1]
            x, y = v[:-1].reshape(-1, args.bptt), v[1:].reshape(-1, args.bptt)
            for i in range(0, x.shape[0], 64):
                total += loss_fn(net, (x[i: i + 64], y[i: i + 64])).item() * x[i: i + 64].shape[0]
                n += x[i: i + 64].shape[0]
    net.train()
    return total / n


def train_one(rank: int, model: str, method: str, data: tuple, args: argparse.Namespace,
              counter: list[int]) -> dict[str, Any]:
    """Train one model with one method from the same seed; rank 0's measurements."""
    train, valid, ntoken = data
    torch.manual_seed(args.seed)
    net, loss_fn = build(model, ntoken)
    ddp = DistributedDataParallel(net)
    state = register(ddp, method, args.warmup)
    steps = args.recsys_steps if model == "recsys" else args.steps
    m = args.lstm_momentum  # (momentum SGD at the same steady-state step: lr scaled by 1 - momentum)
    opt = (torch.optim.SGD(net.parameters(), lr=20.0 * (1.0 - m), momentum=m) if model == "lstm"
           else torch.optim.Adam(net.parameters(), 1e-3))
    times, sent, losses = [], [], []
    omni = method.startswith("omni")  # (bytes: the state's count of what this rank sent, not all_reduce's)
    ring = 2 * (args.world - 1) / args.world
    for step in range(steps):
        batch = batches(model, train, rank, step, args)
        before, t0 = sent_so_far(state, omni, counter, ring), time.perf_counter()
        opt.zero_grad()
        loss = loss_fn(ddp, batch)
        loss.backward()
        if model == "lstm":
            nn.utils.clip_grad_norm_(net.parameters(), 0.25)
        opt.step()
        times.append(time.perf_counter() - t0)
        sent.append(sent_so_far(state, omni, counter, ring) - before)
        losses.append(loss.item())
    val = evaluate(model, net, loss_fn, valid, args)
    grad_bytes = sum(p.numel() * 4 for p in net.parameters())
    steady = slice(args.warmup + 2, None)
    res = {"model": model, "method": method, "seed": args.seed, "world_size": args.world, "steps": steps,
           "params": grad_bytes // 4,
           "val_loss": val, "val_ppl": math.exp(val) if model != "recsys" else None,
           "bytes_per_step_rank": ring * statistics.mean(sent[steady]),
           "bytes_per_step_rank_all_steps": ring * statistics.mean(sent),
           "dense_bytes_per_step_rank": ring * grad_bytes, "median_step_s": statistics.median(times[steady]),
           "train_loss_curve": [statistics.mean(losses[i: i + 10]) for i in range(0, steps, 10)]}
    if state is not None:
        st = state.stats()
        comp = st.get("compression", {}) if omni else st["buckets"]
        res["buckets"] = {i: {k: b[k] for k in ("numel", "k", "density_sent", "union", "residual_norm")}
                          for i, b in comp.items()}
        if omni:
            res["ways"] = {i: {k: b[k] for k in ("numel", "way", "compressed")} for i, b in st["buckets"].items()}
            res["paths"] = {i: p["path"] for i, p in st["paths"].items()}
            state.close()
    gathered: list[Any] = [None] * args.world
    dist.all_gather_object(gathered, val)
    res["val_loss_ranks_agree"] = len(set(gathered)) == 1
    del ddp, state
    gc.collect()  # a DDP reducer collected later, under another method's hooks, can hang Gloo
    return res


def worker(rank: int, model: str, methods: list[str], cfg: dict[str, Any], port: int, out: str) -> None:
    """One rank: every method in turn for one model (one process group, imports paid once)."""
    args = argparse.Namespace(**cfg)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    data = load_corpus(Path(args.data), args.vocab) if model != "recsys" else (None, None, 0)
    counter = count_allreduce()
    results = []
    for method in methods:
        t0 = time.time()
        res = train_one(rank, model, method, data, args, counter)
        res["wall_s"] = time.time() - t0
        results.append(res)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
            print(f"{model:7s} {method:10s} val loss {res['val_loss']:.4f}  "
                  f"{res['bytes_per_step_rank'] / 2**20:9.3f} MiB/step/rank  {1e3 * res['median_step_s']:7.1f} ms/step"
                  f"  ({res['wall_s']:.0f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_model(model: str, methods: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    from omnireduce.launch.procs import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        try:
            mp.spawn(worker, args=(model, methods, vars(args), free_port(), out), nprocs=args.world)
        finally:  # what finished, even if a later method failed
            done = json.loads(Path(out).read_text()) if os.path.exists(out) else []
        return done


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | method | seed | val loss | val ppl | vs dense | bytes/step/rank | of dense | step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, rel in against_dense(results):
        ppl = f"{r['val_ppl']:.1f}" if r["val_ppl"] else "-"
        lines.append(f"| {r['model']} | {r['method']} | {r.get('seed', 0)} | {r['val_loss']:.4f} | {ppl} | "
                     f"{rel:+.2f}% | {r['bytes_per_step_rank'] / 2**20:.3f} MiB | "
                     f"{100 * r['bytes_per_step_rank'] / r['dense_bytes_per_step_rank']:.2f}% | "
                     f"{1e3 * r['median_step_s']:.0f} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 3.6 * len(models)), squeeze=False)
    for row, m in zip(axes, models, strict=True):
        rs = [r for r in results if r["model"] == m]
        names = [r["method"] for r in rs]
        row[0].bar(names, [r["val_loss"] for r in rs], color="tab:blue")
        lo = min(r["val_loss"] for r in rs)
        row[0].set_ylim(lo * 0.97, max(r["val_loss"] for r in rs) * 1.01)
        row[0].set_title(f"{m}: validation loss after {rs[0]['steps']} steps")
        row[1].bar(names, [r["bytes_per_step_rank"] / 2**20 for r in rs], color="tab:orange")
        row[1].set_yscale("log")
        row[1].set_title(f"{m}: MiB sent per step and rank (ring)")
        for r in rs:
            row[2].plot([10 * i for i in range(len(r["train_loss_curve"]))], r["train_loss_curve"], label=r["method"])
        row[2].set_title(f"{m}: training loss (mean of 10 steps, rank 0)")
        row[2].legend(fontsize=7)
        for ax in row[:2]:
            ax.tick_params(axis="x", rotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200, help="steps of the language models")
    ap.add_argument("--recsys-steps", type=int, default=100)
    ap.add_argument("--recsys-batch", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=20, help="dense steps before PowerSGD and ours compress")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--bptt", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--val-tokens", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", default="", help="comma-separated seeds, each a whole run (overrides --seed); "
                                                 "the table then adds each method's mean over the seeds")
    ap.add_argument("--lstm-momentum", type=float, default=0.0,
                    help="the LSTM's SGD momentum (its lr 20 times 1 - momentum); 0: plain SGD as in pytorch/examples")
    ap.add_argument("--data", default=str(ROOT / "scripts" / "data" / "wikitext2-large"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "compression"), help="writes OUT.json, OUT.png")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    saved = vars(args).copy()
    for seed in [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]:
        args.seed = seed
        for model in args.models.split(","):
            results += run_model(model, args.methods.split(","), args)
            Path(args.out + ".json").write_text(json.dumps({"args": saved, "results": results}, indent=1))
    print(table(results))
    if args.seeds:
        print("\n| model | method | seeds | mean val loss | vs dense: mean | min | max | seeds within 1% |\n"
              "|---|---|---|---|---|---|---|---|")
        for s in over_seeds(results):
            print(f"| {s['model']} | {s['method']} | {len(s['seeds'])} | {s['val_loss']:.4f} | {s['gap_mean']:+.2f}% "
                  f"| {s['gap_min']:+.2f}% | {s['gap_max']:+.2f}% | {s['within_1pct']} of {len(s['seeds'])} |")
    plot(results, Path(args.out + ".png"))


if __name__ == "__main__":
    sys.exit(main())
