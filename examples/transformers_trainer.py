"""Hugging Face Transformers Trainer with omnireduce: one call before ``trainer.train()``.

    torchrun --nproc-per-node 2 examples/transformers_trainer.py           # 2 CPU processes (Gloo)
    torchrun --nproc-per-node 2 examples/transformers_trainer.py --plain   # DDP's own all-reduce

The model is a small BERT built from a config (nothing is downloaded) with a 30,522-token vocabulary,
trained on synthetic token sequences: each step touches a few hundred embedding rows, so most of the
embedding gradient is zero. ``use_omnireduce(trainer)`` adds a callback that registers the hook on
the DDP wrapper the trainer makes inside ``train()``. No aggregator to set up: the job starts its
own. ``--save PATH`` saves the parameters before and after training (rank 0), to compare runs.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from omnireduce.integrations import use_omnireduce


class Sequences(torch.utils.data.Dataset):
    """Synthetic token sequences with a label that depends on them."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=gen)
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", action="store_true", help="DDP's own all-reduce (no omnireduce)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--save", default=None, help="save the parameters before and after training here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, num_labels=2)
    model = BertForSequenceClassification(config)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, use_cpu=True, max_steps=args.steps, per_device_train_batch_size=8,
                                     learning_rate=1e-3, report_to=[], save_strategy="no", logging_strategy="no",
                                     disable_tqdm=True, dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=training, train_dataset=Sequences(256, 16, config.vocab_size))
        state = None if args.plain else use_omnireduce(trainer)  # the hook's OmniReduceState
        trainer.train()

    if state is not None:
        s = state.stats()
        print(f"rank {training.process_index}: sent {s['bytes_sent']} bytes where a ring all-reduce sends "
              f"{s['dense_equivalent_bytes']} ({s['buckets_sparse']} buckets through omnireduce, "
              f"{s['buckets_failed']} failed)", flush=True)
    if args.save and training.process_index == 0:
        torch.save({"initial": initial, "final": trainer.model.state_dict()}, args.save)
    # Transformers leaves the process group to the script (Lightning and Accelerate end theirs): a
    # Gloo group still alive when the interpreter shuts down can abort it ("terminate called without
    # an active exception"), omnireduce or not. The state first, then the group it was bound to.
    if state is not None:
        state.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
