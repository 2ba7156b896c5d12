"""``omnireduce.integrations``: :func:`find_ddps` finds every DistributedDataParallel of a model, those
held in plain lists and dicts too (as TorchRec's sharded modules hold their DATA_PARALLEL lookups'),
and ``use_omnireduce`` refuses what it cannot hook. Needs no TorchRec: real DDPs on a one-rank Gloo
group, in a child process (the test process keeps no process group)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_CHILD = r"""
import json
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from omnireduce.integrations import find_ddps

torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:FREE_PORT", rank=0, world_size=1)

class Sharded(nn.Module):  # like TorchRec's ShardedEmbeddingBagCollection: lookups in a plain list
    def __init__(self):
        super().__init__()
        self.registered = nn.Linear(2, 2)
        self._lookups = [DDP(nn.Linear(2, 2)), nn.Linear(2, 2), DDP(nn.Linear(2, 2))]
        self._by_name = {"a": DDP(nn.Linear(2, 2))}
        self._again = [self._lookups[0]]  # held twice: found once

inner = Sharded()
outer = nn.Sequential(nn.Linear(2, 2), inner)
model = DDP(outer)
found = find_ddps(model)
names = [name for name, _ in found]
expected = [model, inner._lookups[0], inner._lookups[2], inner._by_name["a"]]
print(json.dumps({"names": names, "same": [a is b for (_, a), b in zip(found, expected)],
                  "plain_named_modules": sum(isinstance(m, DDP) for m in model.modules())}))
dist.destroy_process_group()
"""


def test_find_ddps_walks_the_lists_and_dicts_modules_hold() -> None:
    from omnireduce.launch.procs import free_port

    r = subprocess.run([sys.executable, "-c", _CHILD.replace("FREE_PORT", str(free_port()))], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["names"] == ["", "module.1._lookups[0]", "module.1._lookups[2]", "module.1._by_name[a]"]
    assert got["same"] == [True] * 4
    assert got["plain_named_modules"] == 1  # what named_modules() alone would have found


def test_use_omnireduce_refuses_what_it_cannot_hook() -> None:
    from omnireduce.ddp import OmniReduceState
    from omnireduce.integrations import use_omnireduce

    with pytest.raises(TypeError, match="Trainer or a TorchRec DistributedModelParallel"):
        use_omnireduce(object())

    class Trainer:  # any object with add_callback is taken for a Transformers Trainer
        def add_callback(self, callback: object) -> None:
            pass

    with pytest.raises(ValueError, match="not both"):
        use_omnireduce(Trainer(), OmniReduceState(), path="dense")
