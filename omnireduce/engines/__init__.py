"""The ways a tensor is all-reduced, one :class:`~omnireduce.engines.reducer.Reducer` each, beside the worker.

- :mod:`~omnireduce.engines.reducer`: the shape they share (``allreduce_async``, its future, its
  typed info), and how a new way is added; :mod:`~omnireduce.engines.ways`: their names and the
  registry of engines of the ranks' own;
- :mod:`~omnireduce.engines.aggregators`: the aggregators, an adapter of :class:`omnireduce.Worker`;
- :mod:`~omnireduce.engines.collective`: :class:`~omnireduce.engines.collective.CollectiveEngine`,
  omnireduce's block-sparse all-reduce with the ranks as aggregators and the group's collectives as
  the wire (the same blocks, layout and sums as the aggregators give);
- :mod:`~omnireduce.engines.dense`: the process group's own all-reduce (and a result's union density);
- :mod:`~omnireduce.engines.hierarchy` and :mod:`~omnireduce.engines.hierarchical`: the hierarchical
  reduction (sum inside each node, then across nodes by rail through any of the others, then share
  inside the node) and the nodes' topology.

They use the block sources (:mod:`omnireduce.sources`) and the CUDA runtime (:mod:`omnireduce.cuda`),
never the worker (its adapter is written against its shape).
"""
