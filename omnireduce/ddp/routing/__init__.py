"""Which way each bucket takes: the one door a bucket passes to find its reducer.

The face is :class:`~omnireduce.ddp.routing.router.Router`: ``route(bucket) -> Route`` for every
bucket, in DDP's order, and ``after_last_bucket(iteration, device)`` once the last bucket of an
iteration is on its way. Behind it, and nowhere else: the per-bucket path choice
(:mod:`~omnireduce.ddp.routing.path_choice`) and its whole-step check
(:mod:`~omnireduce.ddp.routing.step_check`), the paths' names (:mod:`~omnireduce.ddp.routing.path`),
the rules that need no timing (:mod:`~omnireduce.ddp.routing.rules`: the union-density threshold,
compression, the rails'), and the ranks' per-iteration agreement that carries the timings
(:mod:`~omnireduce.ddp.routing.agreement`).
"""

from omnireduce.ddp.routing.router import Route, Router, Ways

__all__ = ["Route", "Router", "Ways"]
