"""DeepCTR-Torch's DeepFM on the Criteo sample under DDP, one rank of a torchrun job: a real client of
the hook, used as its users would (tests/test_deepfm.py runs it; run it by hand for step times).

    torchrun --nproc-per-node 2 tests/scripts/deepfm_ddp.py --hook omnireduce --out /tmp/deepfm.json

Design. Everything model-side is DeepCTR-Torch's own: the data are prepared as its
``examples/run_classification_criteo.py`` prepares them (sparse features label-encoded, dense ones
min-max scaled, ``SparseFeat``/``DenseFeat``, ``get_feature_names``, its train/test split), and each
step does what ``BaseModel.fit()`` does per batch: ``binary_cross_entropy(..., reduction='sum')`` plus
``get_regularization_loss()`` plus ``aux_loss``, Adagrad as ``compile("adagrad", ...)`` makes it. The
L2 penalty covers whole embedding tables, so every gradient is dense: the hook must notice that and
match plain DDP. Only the loop is ours: DDP around the model, the same batches on every rank (one
shuffled order per epoch from a seed shared by all ranks, as fit()'s DataLoader shuffles), each rank
a fixed half of every batch. The CSV is read with the csv module rather than pandas (the same
strings and NaN-as-empty cells; pandas is not a dependency here). Aggregators are the job's own
(colocated: ``OmniReduceState()`` with no addresses). ``--path`` reaches ``OmniReduceState`` only when
given, so the script runs against states with and without that argument.

Rank 0 writes ``--out`` (JSON): the loss of the whole batch per step (all ranks' data losses summed,
plus the regulariser), the median step time in ms over the steps after the first 5 (zero_grad,
forward, backward, optimizer step; not the loss's all-reduce), the hook's ``stats()``, the sizes of
DDP's buckets (at the first step, and after DDP rebuilt them), and the path of the final
``state_dict`` (``torch.save``, beside the JSON).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

# deepctr_torch's import starts a non-daemon thread that asks PyPI for a newer release (requests, no
# timeout). Point that lookup at a closed local port: a run reaches no network and never waits on it.
os.environ["https_proxy"] = os.environ["HTTPS_PROXY"] = "http://127.0.0.1:9"

import numpy as np
import torch
import torch.distributed as dist
from deepctr_torch.inputs import DenseFeat, SparseFeat, get_feature_names
from deepctr_torch.models import DeepFM
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import LabelEncoder, MinMaxScaler
from torch.nn.functional import binary_cross_entropy
from torch.nn.parallel import DistributedDataParallel

from omnireduce.ddp import OmniReduceState, omnireduce_hook

log = logging.getLogger("deepfm_ddp")
DATA = Path(__file__).resolve().parents[1] / "data" / "criteo_sample.txt"
SPARSE = [f"C{i}" for i in range(1, 27)]
DENSE = [f"I{i}" for i in range(1, 14)]
TIMED_AFTER = 5  # the median step time leaves out the first steps (warm-up, the hook's probes)


def load_criteo(path: Path) -> tuple[dict[str, np.ndarray], np.ndarray, list]:
    """The sample as the example prepares it: columns by name, labels, the feature columns."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    data: dict[str, np.ndarray] = {"label": np.array([float(r["label"]) for r in rows])}
    for feat in SPARSE:  # fillna('-1'), then LabelEncoder
        data[feat] = LabelEncoder().fit_transform([r[feat] or "-1" for r in rows])
    dense = np.array([[float(r[feat]) if r[feat] else 0.0 for feat in DENSE] for r in rows])  # fillna(0)
    dense = MinMaxScaler(feature_range=(0, 1)).fit_transform(dense)
    for i, feat in enumerate(DENSE):
        data[feat] = dense[:, i]
    columns = ([SparseFeat(feat, vocabulary_size=int(data[feat].max()) + 1, embedding_dim=4) for feat in SPARSE]
               + [DenseFeat(feat, 1) for feat in DENSE])
    return data, data["label"], columns


def training_rows(path: Path) -> tuple[dict[str, np.ndarray], torch.Tensor, list]:
    """The example's training split as fit() feeds it: one float matrix whose columns follow the
    model's ``feature_index`` (fit() concatenates the inputs in that order), and the labels."""
    data, labels, columns = load_criteo(path)
    names = get_feature_names(columns + columns)
    train_idx, _ = train_test_split(np.arange(len(labels)), test_size=0.2, random_state=2020)
    x = {name: data[name][train_idx] for name in names}
    return x, torch.from_numpy(labels[train_idx]).float(), columns


def batches(n: int, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Row indices of each step's whole batch: a fresh shuffle each epoch (fit()'s DataLoader with
    shuffle=True), from a generator seeded alike on every rank; the last batch of an epoch is short."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    while len(out) < steps:
        order = torch.randperm(n, generator=g)
        out.extend(order[i:i + batch] for i in range(0, n, batch))
    return out[:steps]


def make_state(path: str | None) -> OmniReduceState:
    return OmniReduceState() if path is None else OmniReduceState(path=path)


def bucket_sizes(ddp: DistributedDataParallel) -> dict[str, list[int]]:
    """The bytes of each of DDP's buckets: at the first step (``first``), and as DDP rebuilt them
    after it, in the order the gradients became ready (``later``; the same when not rebuilt)."""
    data = ddp._get_ddp_logging_data()
    first = [int(size) for size in str(data["bucket_sizes"]).split(",")]
    later = [int(size) for size in str(data["rebuilt_bucket_sizes"]).split(",")] if data.get(
        "has_rebuilt_buckets") else first
    return {"first": first, "later": later}


def _jsonable(value: Any) -> Any:
    """``stats()`` with every key a string (JSON), values as they are."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x_cols, y_all, columns = training_rows(Path(args.data))
    model = DeepFM(columns, columns, task="binary", l2_reg_embedding=1e-5, device="cpu")
    x_all = torch.from_numpy(np.concatenate(
        [np.asarray(x_cols[name]).reshape(-1, 1) for name in model.feature_index], axis=-1)).float()
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.hook == "omnireduce":
        state = make_state(args.path)
        ddp.register_comm_hook(state, omnireduce_hook)
    optim = torch.optim.Adagrad(ddp.parameters())  # compile("adagrad"): lr 0.01
    losses, times = [], []
    for idx in batches(len(y_all), args.batch, args.steps, args.seed):
        mine = idx.tensor_split(world)[rank]  # this rank's fixed half of the batch
        x, y = x_all[mine], y_all[mine]
        start = time.perf_counter()
        y_pred = ddp(x).squeeze(-1)
        optim.zero_grad()
        loss = binary_cross_entropy(y_pred, y, reduction="sum")
        reg_loss = model.get_regularization_loss()
        total_loss = loss + reg_loss + model.aux_loss
        total_loss.backward()
        optim.step()
        times.append(time.perf_counter() - start)
        whole = torch.stack([loss.detach(), (reg_loss + model.aux_loss).detach().reshape(())])
        dist.all_reduce(whole[:1])  # the data loss of the whole batch; the regulariser is the same everywhere
        losses.append(float(whole.sum()))
    out: dict[str, Any] = {"hook": args.hook, "path": args.path, "steps": args.steps, "batch": args.batch,
                           "world_size": world, "losses": losses,
                           "median_step_ms": 1000 * statistics.median(times[TIMED_AFTER:] or times),
                           "bucket_sizes": bucket_sizes(ddp),
                           "stats": _jsonable(state.stats()) if state is not None else None}
    if rank == 0:
        params = Path(args.out).with_suffix(".pt")
        torch.save(model.state_dict(), params)
        out["params"] = str(params)
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=64, help="the whole batch; each rank takes its share")
    p.add_argument("--hook", choices=["plain", "omnireduce"], default="omnireduce")
    p.add_argument("--path", choices=["measure", "threshold", "omnireduce", "dense"], default=None,
                   help="OmniReduceState(path=...); left out: the state's default")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default: DDP's)")
    p.add_argument("--seed", type=int, default=2020)
    p.add_argument("--data", default=str(DATA))
    p.add_argument("--out", required=True, help="rank 0 writes the JSON here, the parameters beside it (.pt)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = train(args)
    log.info("rank %d: median step %.1f ms", dist.get_rank(), out["median_step_ms"])
    # DDP models left to the cycle collector still hold Gloo work at interpreter exit: collect them while the
    # process group lives (without this, plain DDP aborted at exit in ~15% of runs here, "terminate called
    # without an active exception", with torch 2.13 and Gloo)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
