"""CUDA sources of omnireduce's block-sparsity kernels, installed as ``omnireduce._csrc`` package data
so that ``omnireduce.cuda.build`` can build them on first use on a CUDA machine."""
