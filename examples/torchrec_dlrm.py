"""TorchRec DLRM with omnireduce: its embedding tables sharded DATA_PARALLEL, one call after sharding.

    torchrun --nproc-per-node 2 examples/torchrec_dlrm.py           # 2 CPU processes (Gloo)
    torchrun --nproc-per-node 2 examples/torchrec_dlrm.py --plain   # TorchRec's own all-reduce

A DLRM (``torchrec.models.dlrm``) over three 20,000-row tables, every table replicated
(``data_parallel()`` in the sharding plan), so their gradients are all-reduced like the MLPs': through
the DDP TorchRec wraps around each DATA_PARALLEL lookup, not through the one around the dense part.
A batch of 32 touches a few dozen rows per table: most of the tables' gradient is zero.
``use_omnireduce(model)`` registers the hook on every DDP of the ``DistributedModelParallel``, all at
the aggregators the job starts for itself. ``--save PATH`` saves the parameters before and after
training (rank 0), to compare runs.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.keyed import KeyedOptimizerWrapper

from omnireduce.integrations import use_omnireduce

TABLES, ROWS, DIM, DENSE_IN, BATCH = 3, 20_000, 16, 8, 32


def make_model(seed: int = 0) -> DLRM:
    """The DLRM, the same on every rank (seeded; sharding on a CPU makes new tables, the same on every
    rank too: the lookups' DDP broadcasts rank 0's)."""
    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
              for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[32, DIM],
                over_arch_layer_sizes=[32, 1])


def batch(step: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
    """Synthetic dense features, ids (1 to 3 per sample and table, skewed to the first rows) and labels."""
    gen = torch.Generator().manual_seed(1_000_000 * seed + 1000 * step + rank)
    dense = torch.randn(BATCH, DENSE_IN, generator=gen)
    lengths = torch.randint(1, 4, (TABLES * BATCH,), generator=gen)
    ids = (torch.rand(int(lengths.sum()), generator=gen) ** 3 * ROWS).long()
    sparse = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(TABLES)], values=ids, lengths=lengths)
    labels = (dense[:, 0] > 0).float()
    return dense, sparse, labels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", action="store_true", help="TorchRec's own all-reduce (no omnireduce)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="of the model and the batches")
    ap.add_argument("--path", default=None, help="the hook's path knob (default: measure)")
    ap.add_argument("--save", default=None, help="save the parameters before and after training here (rank 0)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    model = make_model(args.seed)
    ebc = model.sparse_arch.embedding_bag_collection
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {f"t{i}": data_parallel() for i in range(TABLES)}, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)  # (new tables, on a CPU)
    initial = {k: v.detach().clone() for k, v in dmp.state_dict().items()}
    reduced = None if args.plain else use_omnireduce(dmp, path=args.path)  # before the first forward
    optimizer = KeyedOptimizerWrapper(dict(dmp.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.5))

    for step in range(args.steps):
        dense, sparse, labels = batch(step, rank, args.seed)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(dense, sparse).squeeze(1), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0 and step in (0, args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)

    if reduced is not None:
        s = reduced.stats()
        lines = [f"rank {rank}: sent {s['bytes_sent']} bytes where a ring all-reduce sends "
                 f"{s['dense_equivalent_bytes']} ({s['buckets_sparse']} buckets through omnireduce, "
                 f"{s['buckets_dense']} dense, {s['buckets_failed']} failed)"]
        lines += [f"rank {rank}: {name}: {d['buckets_sparse']} sparse, {d['buckets_dense']} dense, "
                  f"{d['buckets_failed']} failed, sent {d['bytes_sent']} of {d['dense_equivalent_bytes']}"
                  for name, d in s["per_ddp"].items()]
        # one write of whole lines: the ranks share the terminal, and print's text and its newline
        # go out as two writes that another rank's line can fall between
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    if args.save and rank == 0:
        final = {k: v.detach().clone() for k, v in dmp.state_dict().items()}
        torch.save({"initial": initial, "final": final}, args.save)
    if reduced is not None:
        reduced.close()  # the lookups' states, then the first, which stops the aggregators it started
    # Every rank done, then the DDPs (their reducers hold the process group and Gloo work) freed before
    # the group is destroyed: left to the interpreter's shutdown, they can abort the process at exit
    # ("terminate called without an active exception"; seen once in a plain TorchRec run here).
    dist.barrier()
    del optimizer, dmp, model, ebc
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
