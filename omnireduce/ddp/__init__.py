"""The DDP side of omnireduce: a communication hook, its state, and optimizer fusion.

    from omnireduce.ddp import OmniReduceState, omnireduce_hook
    ddp_model.register_comm_hook(OmniReduceState(), omnireduce_hook)   # averages, like DDP's default

The package's layers, top down (imports point down only):

- :mod:`~omnireduce.ddp.hook`: the hook, a dispatcher; :mod:`~omnireduce.ddp.fusion`: optimizer
  steps per bucket (``fuse_optimizer``);
- :mod:`~omnireduce.ddp.state`: the user's options (:mod:`~omnireduce.ddp.options`) and, once bound,
  a runtime, built whole by :mod:`~omnireduce.ddp.binding` (:mod:`~omnireduce.ddp.runtime`), which
  executes each bucket's route;
- :mod:`~omnireduce.ddp.routing.router`: the whole path decision: a :class:`~omnireduce.ddp.routing.router.Route`
  per bucket that carries its reducer (:mod:`omnireduce.engines.reducer`: the aggregators, the
  collective engine, the dense all-reduce, the hierarchy), with the path choice
  (:mod:`~omnireduce.ddp.routing.path_choice`, :mod:`~omnireduce.ddp.routing.step_check`, the paths' names in
  :mod:`~omnireduce.ddp.routing.path`) and the ranks' agreement (:mod:`~omnireduce.ddp.routing.agreement`);
- :mod:`~omnireduce.ddp.paths`: what the hook does around a reducer for compressed buckets and for
  sparse COO ones; :mod:`~omnireduce.ddp.recorder`: where every reduction reports;
- :mod:`~omnireduce.ddp.bucket`, :mod:`~omnireduce.ddp.densities`, :mod:`~omnireduce.ddp.alignment`:
  what a bucket is, its union densities, its blocks' alignment.
"""

from omnireduce.ddp.fusion import HookType, fuse_optimizer
from omnireduce.ddp.hook import omnireduce_hook
from omnireduce.ddp.state import OmniReduceState

__all__ = ["HookType", "OmniReduceState", "fuse_optimizer", "omnireduce_hook"]
