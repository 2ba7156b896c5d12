"""The ways a DDP bucket is reduced once the router has picked one, one module each.

Each path starts a reduction and returns the future the hook hands to DDP. None decides anything
(:mod:`omnireduce.ddp.router` does) and none sees the state: each gets the bucket, the engine it
drives and the :class:`~omnireduce.ddp.recorder.Recorder` it reports to.

- :mod:`~omnireduce.ddp.paths.dense`: the process group's all-reduce;
- :mod:`~omnireduce.ddp.paths.aggregators`: the worker's I/O thread and the aggregators;
- :mod:`~omnireduce.ddp.paths.collective`: the collective engine (the ranks sum each other's blocks);
- :mod:`~omnireduce.ddp.paths.coo`: sparse COO gradients, batched over a backward pass;
- :mod:`~omnireduce.ddp.paths.hierarchy`: inside the node, across nodes by rail, inside the node.
"""
