"""torch's own all_reduce tests, run against omnireduce.distributed.

    BACKEND=gloo WORLD_SIZE=3 python tests/scripts/torch_all_reduce_tests.py [-k PATTERN]

torch's test suite for torch.distributed (``torch.testing._internal.distributed.distributed_test``)
runs here as torch ships it, its ranks real processes on a real Gloo group, with
``torch.distributed.all_reduce`` and ``torch.distributed.all_reduce_coalesced`` replaced by
omnireduce's in every rank: the ``all_reduce`` tests (sums, async handles, subgroups, full groups,
products, minima, maxima, complex tensors, coalesced calls, sparse tensors) check omnireduce's results
with torch's own expectations. One thing of torch's is left out: each call's profiler check (that the
backend recorded one ``gloo:all_reduce`` event of the tensor's shape), which is about how the call was
carried, not what it gave: omnireduce carries it by other collectives on a group of its own.
"""

from __future__ import annotations

import os
import sys
import unittest

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")

import torch.distributed as dist
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

import omnireduce.distributed

dist.all_reduce = omnireduce.distributed.all_reduce
dist.all_reduce_coalesced = omnireduce.distributed.all_reduce_coalesced


class TorchAllReduceTests(TestDistBackend, DistributedTest._DistTestBase):
    """torch's all_reduce tests (see the module); ranks spawned per test, as torch's own runner does."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def call_dist_op(self, profiling_title_postfix, is_async, op, *args, expect_event=True,
                     secondary_op_call=None, profile_cuda=False, tensor_shapes=None, **kwargs):
        """torch's helper without its profiler check (see the module): the call (and a second one), and on
        async calls each handle's wait()."""
        works = [op(*args, **kwargs)] + ([secondary_op_call()] if secondary_op_call is not None else [])
        if is_async:
            for work in works:
                work.wait()


def load_tests(loader: unittest.TestLoader, tests: unittest.TestSuite, pattern: str | None) -> unittest.TestSuite:
    names = [n for n in loader.getTestCaseNames(TorchAllReduceTests)
             if ("all_reduce" in n and "cuda" not in n and "nccl" not in n)]
    return unittest.TestSuite(TorchAllReduceTests(n) for n in names)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1] + sys.argv[1:], verbosity=2)
