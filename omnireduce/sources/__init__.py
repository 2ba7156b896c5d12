"""Block sources: where a tensor's blocks come from and where their sums go.

Shared by the worker (:mod:`omnireduce.worker`), the collective engine (:mod:`omnireduce.engines`)
and the DDP hook's densities. :func:`~omnireduce.sources.adapt.adapt` picks one per tensor:

- :mod:`~omnireduce.sources.host`: numpy arrays and CPU torch tensors (a flat numpy view);
- :mod:`~omnireduce.sources.device`: torch tensors on their device (CUDA), compacted there;
- :mod:`~omnireduce.sources.sparse`: the rows of a sparse COO tensor (embedding gradients).

All keep the contract of :class:`~omnireduce.sources.base.Source`. torch is imported only when a
torch tensor is met.
"""
