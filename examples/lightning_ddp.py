"""PyTorch Lightning with omnireduce: one strategy argument, nothing else changes.

    python examples/lightning_ddp.py                # Lightning starts 2 CPU processes itself
    python examples/lightning_ddp.py --plain        # the same run with DDP's own all-reduce

No aggregator to set up: the job starts its own. The hook's state is made before Lightning
initialises torch.distributed and binds at the hook's first call. On GPUs,
``DDPStrategy(ddp_comm_state=OmniReduceState(), ddp_comm_hook=omnireduce_hook)`` does the same;
Lightning registers a hook given that way on CUDA only, so this example (CPU) uses
``OmniReduceDDPStrategy``, which registers it on any device. ``--save PATH`` saves the trained
parameters before and after training (rank 0), to compare runs.
"""

from __future__ import annotations

import argparse

import lightning as L  # noqa: N812 (Lightning's own spelling)
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from omnireduce.integrations import OmniReduceDDPStrategy

ROWS = 50_000


class Recommender(L.LightningModule):
    """A large embedding table (each step touches a few rows: sparse gradients) under a small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.EmbeddingBag(ROWS, 16, mode="sum")
        self.head = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        ids, target = batch
        return torch.nn.functional.mse_loss(self.head(self.emb(ids)), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", action="store_true", help="DDP's own all-reduce (no omnireduce)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save", default=None, help="save the parameters before and after training here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, ROWS, (1024, 8), generator=gen), torch.randn(1024, 1, generator=gen))

    strategy = DDPStrategy() if args.plain else OmniReduceDDPStrategy()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Recommender()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, DataLoader(data, batch_size=32))

    if not args.plain:
        s = strategy.omnireduce_state.stats()
        print(f"rank {trainer.global_rank}: sent {s['bytes_sent']} bytes where a ring all-reduce sends "
              f"{s['dense_equivalent_bytes']} ({s['buckets_sparse']} buckets through omnireduce, "
              f"{s['buckets_failed']} failed)", flush=True)
    if args.save and trainer.global_rank == 0:
        torch.save({"initial": initial, "final": model.state_dict()}, args.save)


if __name__ == "__main__":
    main()
