"""omnireduce on CUDA (and torch generally): the block operations (:mod:`~omnireduce.cuda.ops`), the
build of their kernels (:mod:`~omnireduce.cuda.build`) and the runtime the worker and the engines
share (:mod:`~omnireduce.cuda.runtime`: omnireduce's own side streams, the pinned buffer pool, one
thread per device).

Nothing is imported here: :mod:`~omnireduce.cuda.runtime` loads without torch (it is handed the
module), the other two import torch.
"""
