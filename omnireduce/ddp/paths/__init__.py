"""What the hook does around a reducer for two kinds of bucket (the reducers themselves are
:mod:`omnireduce.engines`' :class:`~omnireduce.engines.reducer.Reducer` implementations).

None decides anything (:mod:`omnireduce.ddp.routing.router` does) and none sees the state.

- :mod:`~omnireduce.ddp.paths.compressed`: block top-k with error feedback around any reducer;
- :mod:`~omnireduce.ddp.paths.coo`: sparse COO gradients, batched over a backward pass.
"""
