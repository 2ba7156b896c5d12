#!/usr/bin/env python3
"""Which blocks to send: four selections for block top-k with error feedback, measured on real gradients.

W ranks are simulated in one process: each step every rank computes the gradient of the GPT-2-shaped model
of scripts/bench_compression.py on its own batch of wikitext-2, and the model follows the dense (exact
average) trajectory with Adam, so every selection sees the same gradients ("open loop"; convergence of
the default is measured by scripts/bench_compression.py). Each selection keeps its own residuals per rank:

* ``shared``: block scores (squared norms) summed over ranks (an all-reduce of 1/B of the bucket), the
  same top-k everywhere: union exactly k;
* ``stale``: the previous step's summed scores (carried by the previous all-reduce): union exactly k;
* ``local``: each rank's own top-k (omnireduce's sparse path would sum them): union up to W k;
* ``threshold``: DCT-style, each rank's k-th largest score taken as its threshold every ``--refresh``
  steps, then every block above it is sent: union and per-rank counts drift between refreshes.

Reported per selection and W: union / k (mean, max over steps), blocks sent per rank / k, the relative
error of the step's average update against the dense average gradient (mean over steps), the fraction
of the dense gradient's energy the update carries over all steps (``sum <u, g> / sum |g|^2``), bytes per
rank and step (ring all-reduce for the shared-index selections, sparse up + down for the others), and
the selection's compute time per rank.

    python scripts/bench_compression_selection.py          # writes docs/log/data/compression_selection.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compression import ROOT, batches, build, load_corpus

SELECTIONS = ["shared", "stale", "local", "threshold"]


class Sim:
    """One selection's residuals for W ranks and its running measurements."""

    def __init__(self, name: str, W: int, n: int, B: int, k: int, refresh: int) -> None:
        self.name, self.W, self.n, self.B, self.k, self.refresh = name, W, n, B, k, refresh
        self.nb = -(-n // B)
        self.res = torch.zeros(W, self.nb * B)
        self.stale: torch.Tensor | None = None
        self.tau: torch.Tensor | None = None
        self.m: dict[str, list[float]] = {"union": [], "per_rank": [], "rel_err": [], "dot": [], "gg": [],
                                          "select_s": [], "bytes": []}

    def step(self, t: int, grads: torch.Tensor) -> None:
        W, B, nb, k = self.W, self.B, self.nb, self.k
        self.res[:, : self.n] += grads
        blocks = self.res.view(W, nb, B)
        t0 = time.perf_counter()
        scores = blocks.square().sum(2)  # (W, nb)
        if self.name in ("shared", "stale"):
            summed = scores.sum(0)
            use = summed if self.name == "shared" or self.stale is None else self.stale
            idx = torch.topk(use, k, sorted=False).indices
            self.stale = summed
            mask = torch.zeros(W, nb, dtype=torch.bool)
            mask[:, idx] = True
        elif self.name == "local":
            idx = torch.topk(scores, k, dim=1, sorted=False).indices
            mask = torch.zeros(W, nb, dtype=torch.bool).scatter_(1, idx, True)
        else:
            if self.tau is None or t % self.refresh == 0:
                self.tau = torch.topk(scores, k, dim=1).values[:, -1:]
            mask = scores >= self.tau
        self.m["select_s"].append((time.perf_counter() - t0) / W)
        sent = blocks * mask[:, :, None]
        update = sent.sum(0).reshape(-1)[: self.n] / W
        blocks.masked_fill_(mask[:, :, None], 0.0)
        g = grads.mean(0)
        union = int(mask.any(0).sum())
        per_rank = float(mask.sum(1).float().mean())
        self.m["union"].append(union / k)
        self.m["per_rank"].append(per_rank / k)
        self.m["rel_err"].append(float((update - g).norm() / g.norm()))
        self.m["dot"].append(float(update @ g))
        self.m["gg"].append(float(g @ g))
        ring = 2 * (W - 1) / W
        if self.name in ("shared", "stale"):
            self.m["bytes"].append(ring * 4 * (k * B + nb))
        else:  # each rank sends its blocks (values + a 4-byte index) and receives the union's sums
            self.m["bytes"].append((per_rank + union) * (4 * B + 4))

    def summary(self, dense_bytes: float) -> dict[str, Any]:
        m = self.m
        return {"selection": self.name, "world_size": self.W, "union_over_k_mean": sum(m["union"]) / len(m["union"]),
                "union_over_k_max": max(m["union"]), "sent_per_rank_over_k": sum(m["per_rank"]) / len(m["per_rank"]),
                "rel_err_mean": sum(m["rel_err"]) / len(m["rel_err"]), "energy": sum(m["dot"]) / sum(m["gg"]),
                "select_ms_per_rank": 1e3 * sorted(m["select_s"])[len(m["select_s"]) // 2],
                "bytes_per_step_rank": sum(m["bytes"]) / len(m["bytes"]),
                "of_dense_bytes": sum(m["bytes"]) / len(m["bytes"]) / dense_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--refresh", type=int, default=50, help="threshold selection: steps between threshold updates")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bptt", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=str(ROOT / "scripts" / "data" / "wikitext2"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "log" / "data" / "compression_selection.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    train, _valid, ntoken = load_corpus(Path(args.data), args.vocab)
    torch.manual_seed(args.seed)
    net, loss_fn = build("gpt2", ntoken)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    params = list(net.parameters())
    n = sum(p.numel() for p in params)
    worlds = [int(w) for w in args.worlds.split(",")]
    nb = -(-n // args.block_size)
    k = max(1, round(args.density * nb))
    sims = [Sim(s, W, n, args.block_size, k, args.refresh) for W in worlds for s in SELECTIONS]
    for t in range(args.steps):
        grads = []
        for r in range(max(worlds)):
            net.zero_grad()
            loss_fn(net, batches("gpt2", train, r, t, args)).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        grads_t = torch.stack(grads)
        for sim in sims:
            sim.step(t, grads_t[: sim.W])
        # the dense trajectory: the average over the largest world's ranks
        avg = grads_t.mean(0)
        offset = 0
        for p in params:
            p.grad.copy_(avg[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
    results = [s.summary(2 * (s.W - 1) / s.W * 4 * n) for s in sims]
    Path(args.out).write_text(json.dumps({"args": vars(args), "numel": n, "blocks": nb, "k": k,
                                          "results": results}, indent=1))
    print(f"{n} values, {nb} blocks of {args.block_size}, k = {k} (density {args.density}), {args.steps} steps")
    print("| W | selection | union/k mean | union/k max | sent/rank/k | rel. error | energy | bytes of dense | "
          "select ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['world_size']} | {r['selection']} | {r['union_over_k_mean']:.2f} | {r['union_over_k_max']:.2f} | "
              f"{r['sent_per_rank_over_k']:.2f} | {r['rel_err_mean']:.3f} | {r['energy']:.3f} | "
              f"{100 * r['of_dense_bytes']:.2f}% | {r['select_ms_per_rank']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
