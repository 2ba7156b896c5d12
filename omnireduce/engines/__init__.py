"""The engines beside the worker: reductions that run over a ``torch.distributed`` process group.

- :mod:`~omnireduce.engines.collective`: :class:`~omnireduce.engines.collective.CollectiveEngine`,
  omnireduce's block-sparse all-reduce with the ranks as aggregators and the group's collectives as
  the wire (the same blocks, layout and sums as the aggregators give);
- :mod:`~omnireduce.engines.hierarchy`: the hierarchical reduction (sum inside each node, then
  across nodes by rail, then share inside the node) and the nodes' topology.

Both use the block sources (:mod:`omnireduce.sources`) and the CUDA runtime (:mod:`omnireduce.cuda`),
never the worker.
"""
