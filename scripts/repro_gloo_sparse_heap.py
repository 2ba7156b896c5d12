"""Reproduce a heap corruption in torch's default DDP with sparse gradients over Gloo, and show
which models hit it and that omnireduce_hook does not.

Each row runs ``--runs`` jobs of 2 or 3 real Gloo ranks (spawned processes). In every job each rank builds
``--models`` DDP models one after another and trains each for 5 steps on a model with sparse
embedding tables, a dense table and an MLP. A job counts as corrupted when a rank dies of glibc's heap
checks (``malloc(): unaligned tcache chunk detected``, ``double free or corruption``) or a segfault.
Prints the table and saves it (``--out``).

    python scripts/repro_gloo_sparse_heap.py --runs 6 --out docs/log/data/gloo_sparse_heap/repro.txt
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROWS = 3000
CORRUPTION = ("unaligned tcache", "double free", "corrupted", "malloc():", "free():")

# (label, ranks, sparse tables, unused parameter, find_unused_parameters, hook)
CASES = [
    ("default DDP: 2 sparse tables, an unused parameter, find_unused", 2, 2, True, True, "default"),
    ("default DDP: 2 sparse tables, no unused parameter, find_unused", 2, 2, False, True, "default"),
    ("default DDP: 1 sparse table, an unused parameter, find_unused", 2, 1, True, True, "default"),
    ("default DDP: 2 sparse tables, no unused parameter, 3 ranks", 3, 2, False, False, "default"),
    ("DDP, sparse gradients all-reduced as dense tensors: 2 sparse tables, unused, find_unused", 2, 2, True, True,
     "dense"),
    ("omnireduce_hook (aggregators): 2 sparse tables, unused, find_unused", 2, 2, True, True, "omnireduce"),
    ("omnireduce_hook (collective engine): 2 sparse tables, unused, find_unused", 2, 2, True, True, "collective"),
]


def _rank(rank: int, port: int, case: tuple, models: int, aggregator: str, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)  # glibc writes its abort message to the terminal or stderr: keep it
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    _, world, sparse_tables, unused, find_unused, hook = case

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            tables = [nn.Embedding(ROWS, 16, sparse=True), nn.EmbeddingBag(ROWS // 3, 8, mode="sum", sparse=True)]
            self.tables = nn.ModuleList([*tables[:sparse_tables], nn.EmbeddingBag(2000, 12, mode="sum")])
            self.mlp = nn.Sequential(nn.Linear(sum(t.embedding_dim for t in self.tables), 64), nn.ReLU(),
                                     nn.Linear(64, 1))
            if unused:
                self.unused = nn.Linear(4, 4)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            outs = [t(idx % t.num_embeddings) if isinstance(t, nn.EmbeddingBag) else t(idx % t.num_embeddings).sum(1)
                    for t in self.tables]
            return self.mlp(torch.cat(outs, dim=1)).squeeze(1)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    for i in range(models):
        torch.manual_seed(i)
        model = DistributedDataParallel(Net(), bucket_cap_mb=0.05, find_unused_parameters=find_unused)
        state = None
        if hook == "dense":
            from tests.sparse_ddp_cases import dense_reference_hook

            model.register_comm_hook(None, dense_reference_hook)
        elif hook != "default":
            from omnireduce.ddp import OmniReduceState, omnireduce_hook

            state = (OmniReduceState(aggregators=[aggregator], timeout=30) if hook == "omnireduce"
                     else OmniReduceState(engine="collective", timeout=30))
            model.register_comm_hook(state, omnireduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(5):
            opt.zero_grad()
            idx = torch.randint(0, ROWS, (16, 4), generator=g)
            ((model(idx) - torch.randn(16, generator=g)) ** 2).mean().backward()
            opt.step()
        if state is not None:
            state.close()
        del model, opt
    dist.destroy_process_group()


def _job(case: tuple, models: int, aggregator: str) -> str:
    """One job: "ok", "corrupted" or "failed" (another death)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        logs = [str(Path(d) / f"rank{r}.log") for r in range(case[1])]
        procs = [ctx.Process(target=_rank, args=(r, port, case, models, aggregator, log)) for r, log in enumerate(logs)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        text = "".join(Path(f).read_text(errors="replace") for f in logs if Path(f).exists())
        codes = [p.exitcode for p in procs]
    if any(c in (-6, -11) for c in codes) and (any(m in text for m in CORRUPTION) or -11 in codes):
        return "corrupted"
    return "ok" if all(c == 0 for c in codes) else "failed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=6, help="jobs per row")
    ap.add_argument("--models", type=int, default=20, help="DDP models per rank in one job")
    ap.add_argument("--out", type=Path, help="save the table here")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    import omnireduce

    lines = [f"torch {torch.__version__}; {args.runs} jobs per row, {args.models} models x 5 steps per rank", "",
             "| case | ranks | jobs corrupted | other failures | seconds |", "|---|---|---|---|---|"]
    with omnireduce.Aggregator() as agg:
        for case in CASES:
            t0 = time.monotonic()
            results = [_job(case, args.models, agg.address) for _ in range(args.runs)]
            lines.append(f"| {case[0]} | {case[1]} | {results.count('corrupted')} of {args.runs} | "
                         f"{results.count('failed')} | "
                         f"{time.monotonic() - t0:.0f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
