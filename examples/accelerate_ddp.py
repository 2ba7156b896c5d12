"""Hugging Face Accelerate with omnireduce: register the hook on the model accelerator.prepare wrapped.

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py            # 2 CPU processes (Gloo)
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --plain    # DDP's own all-reduce

No aggregator to set up: the job starts its own. Only two lines differ from plain Accelerate: the
import and ``register_comm_hook`` after ``accelerator.prepare``. ``--save PATH`` saves the
parameters before and after training (rank 0), to compare runs.
"""

from __future__ import annotations

import argparse
import itertools

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from omnireduce.ddp import OmniReduceState, omnireduce_hook

ROWS = 50_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", action="store_true", help="DDP's own all-reduce (no omnireduce)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save", default=None, help="save the parameters before and after training here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(ROWS, 16, mode="sum"), torch.nn.Linear(16, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, ROWS, (1024, 8), generator=gen), torch.randn(1024, 1, generator=gen))
    loader = DataLoader(data, batch_size=32)

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # model: DistributedDataParallel
    state = None
    if not args.plain:
        state = OmniReduceState()
        model.register_comm_hook(state, omnireduce_hook)

    for ids, target in itertools.islice(loader, args.steps):
        loss = torch.nn.functional.mse_loss(model(ids), target)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    if state is not None:
        s = state.stats()
        print(f"rank {accelerator.process_index}: sent {s['bytes_sent']} bytes where a ring all-reduce sends "
              f"{s['dense_equivalent_bytes']} ({s['buckets_sparse']} buckets through omnireduce, "
              f"{s['buckets_failed']} failed)", flush=True)
    if args.save and accelerator.is_main_process:
        torch.save({"initial": initial, "final": accelerator.unwrap_model(model).state_dict()}, args.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
