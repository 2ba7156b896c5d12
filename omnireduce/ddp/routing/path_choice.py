"""Which path each DDP bucket takes, chosen by timing them: omnireduce or the dense all-reduce.

Design. Where omnireduce beats the process group's own all-reduce depends on the links, the
cores, the GPUs, the number of ranks and the bucket's density; no threshold fits every cluster.
So the hook times the paths on the bucket itself and keeps the fastest, per bucket. The paths
(``PathChoice(paths=...)``) are the dense all-reduce and one or two ways through omnireduce: the
aggregators (``"aggregators"``) and the collective engine (``"collective"``, the ranks summing each
other's blocks); two in what follows, the rule is the same for three:

1. Measuring. A bucket seen for the first time (the first iteration, and again after DDP
   rebuilds its buckets: a rebuilt bucket is a new key) takes the paths in turn, on successive
   calls: ``warmup`` untimed calls of each, then ``trials`` timed ones of each. Bucket ``i``
   starts ``i`` paths later (even ones with omnireduce, odd ones with the dense all-reduce), so
   that in an iteration where several buckets are measured about half take each path: a bucket's
   two timings then see similar traffic from the others. (Had every bucket taken the same path
   together, each timing would include the wait behind every earlier bucket on that one path, and
   the comparison would be "all buckets dense" against "all through omnireduce" rather than this
   bucket's.) A trial is timed from the hook's call to its future's completion: on the host with the clock,
   on CUDA with two events (one recorded on the producing stream at the call, one on the stream
   the result is ready on), read when the decision is proposed, an iteration or more later, and
   never waited for (a trial whose events have not completed yet counts as missing).
2. Agreeing. Every rank must send a bucket the same way, so no rank decides alone. At the last
   bucket of an iteration after a bucket's last trial, each rank proposes its medians of both
   paths (in microseconds, negated), which ride along with the per-iteration all-reduce (MIN) of
   the aggregators' reachability (:mod:`omnireduce.ddp.routing.agreement`); at the next iteration's first
   bucket every rank reads the same result: the slowest rank's median of each path. The faster
   path wins (a tie, or no timing of omnireduce, goes dense: DDP's own choice). Until then the
   bucket keeps its previous path (the first time: the union-density threshold rule).
3. Checked on whole steps. A bucket's own time misses what omnireduce costs the rest of the step
   (CPU or device time the backward pass and the other buckets' all-reduces would have used).
   So once every bucket is decided and the plan sends a bucket through omnireduce that did not
   go that way before, whole steps of the plan are timed against whole steps with those buckets
   dense, on alternate iterations (:mod:`omnireduce.ddp.routing.step_check`, ``trials`` of each), agreed the
   same way; the plan stays only if its steps are faster, else its omnireduce buckets go dense.
   A compressed bucket's dense way is ``"uncompressed"`` (the whole bucket, as DDP would send it): the
   check asks whether the plan beats plain DDP's steps.
4. Flat or hierarchical. Where nodes hold several ranks and ``hierarchical`` is left to
   ``auto`` (``hierarchy``; :mod:`omnireduce.ddp.routing.router`), the hierarchy runs beside the flat path and
   whether the buckets take it is measured on whole steps: once the buckets are decided (their
   flat paths, measured as above), the step check runs three ways in turn, every decided bucket
   through the hierarchy (its path taking the shards across the nodes: ``"hier:aggregators"``,
   ``"hier:collective"``, ``"hier:dense"``; a compressed bucket's compacted blocks, or with
   ``"hier:uncompressed"`` the whole bucket, cross so too), every bucket flat, every bucket dense, and keeps the
   fastest (a tie goes flat, then dense); ``stats()["paths"]`` names the way each bucket goes. Its
   in-node steps cost the whole step (CPU, the node's interconnect), not one bucket, and the
   measurement stays as short as the flat one: the same per-bucket trials, then a check of 9
   iterations instead of 6 (of 6 where every bucket is dense flat: the hierarchy against dense).
   The check runs again whenever a decision changes.
5. Decided. A decided bucket costs a dictionary lookup: no scan of a dense bucket. (A bucket the
   router sends dense untimed, every way through omnireduce sending it whole, is only reported:
   :meth:`PathChoice.settle`.) It is
   measured again, one bucket at a time: when its union density (known for free on the
   omnireduce path, identical on every rank) drifts by more than ``drift`` times from what it was
   when decided, or, round robin, one bucket every ``remeasure_every`` iterations. With the
   defaults (1 + 3 calls of each path) a re-measurement spans 4 iterations per path (8 or 12),
   and by default one starts every 50 times that (400 or 600 iterations): 2% of them (and 6 more,
   1-1.5% more, when it sends a bucket back to omnireduce: the step check).

Everything that steers the schedule (calls per bucket, iterations, union densities, the agreed
medians) is identical on every rank, so every rank takes the same path at the same bucket. This
module holds no sockets and no process group: the hook asks it which path to take
(:meth:`PathChoice.choose`), marks every bucket's call (:meth:`PathChoice.mark`: the first of an
iteration times the step), hands it the futures to time (:meth:`Trial.watch`), and the agreement
carries its proposals (:meth:`PathChoice.proposal`, :meth:`PathChoice.agreed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from omnireduce.ddp.bucket import BucketKey, is_compressed
from omnireduce.ddp.routing.path import DENSE, Path, Span
from omnireduce.ddp.routing.step_check import StepCheck
from omnireduce.ddp.routing.timing import Trial, negated_median_us
from omnireduce.engines.ways import Way

log = logging.getLogger("omnireduce.ddp")

def via_hierarchy(path: str) -> Path:
    """The path that takes ``path``'s way across the nodes, through the hierarchy."""
    return Path(path).through_hierarchy()


def split(path: str) -> tuple[bool, Path]:
    """Whether ``path`` goes through the hierarchy, and its way (across the nodes, if so)."""
    p = Path(path)
    return p.hierarchical, p.flat


def dense_way(key: BucketKey) -> Path:
    """Bucket ``key``'s way without omnireduce: the dense all-reduce (a compressed bucket's: whole, uncompressed)."""
    return Path.UNCOMPRESSED if is_compressed(key) else DENSE


def fastest(times: dict[Path, float | None]) -> Path:
    """The fastest timed path of ``times`` (a tie goes uncompressed, then dense, then to the first listed; none
    timed: uncompressed where measured, else dense)."""
    rank = {Path.UNCOMPRESSED: 0, DENSE: 1}  # (ties: DDP's own way first, a compressed bucket's whole one before)
    timed = [(t, rank.get(p, 2), i, p) for i, (p, t) in enumerate(times.items()) if t is not None]
    return min(timed)[3] if timed else Path.UNCOMPRESSED if Path.UNCOMPRESSED in times else DENSE
MEASURING, AWAITING, DECIDED = "measuring", "awaiting", "decided"
WHOLE = "whole"  # dense without measuring: every way through omnireduce would send it whole (:meth:`PathChoice.settle`)


@dataclass
class BucketPath:
    """One bucket's path, its phase and its measurements."""

    key: BucketKey
    path: Path | None = None  # the agreed path (None: never decided yet)
    phase: str = MEASURING
    calls: int = 0  # calls since the current measurement started
    trials: list[Trial] = field(default_factory=list)
    last_trial_iteration: int = -1
    last_call_iteration: int = -1
    decided_at: int | None = None  # the iteration whose first bucket applied the last decision
    times_ms: dict[Path, float | None] = field(default_factory=dict)  # path -> agreed median (None: not timed)
    density_at_decision: float | None = None
    measurements: int = 0  # measurements completed (decisions made)
    vetoed: bool = False  # timed faster another way, sent dense (or flat) by the step check

    def report(self, path: Path | None) -> dict[str, object]:
        """Plain values only (``path``: the way it takes now, by name)."""
        times = {f"{p}_ms": t for p, t in self.times_ms.items()}
        return {"path": None if path is None else str(path), "phase": self.phase, **times,
                "decided_at": self.decided_at, "measurements": self.measurements, "numel": self.key[1],
                "vetoed_by_step_check": self.vetoed, "compressed": is_compressed(self.key)}


class PathChoice:
    """The per-bucket path choice of one hook state (see the module docstring).

    Args:
        trials: timed calls of each path per measurement (their median counts).
        warmup: untimed calls of each path before the trials (connections, buffers, caches).
        remeasure_every: iterations between two periodic re-measurements, one bucket at a time,
            round robin over the decided buckets (0: never; None: 50 measurements' length, so
            that 2% of the iterations measure: 400 with two paths, 600 with three).
        drift: a bucket decided while its union density was ``d`` is measured again once the
            density leaves ``[d / drift, d * drift]`` (densities under 1e-4 count as 1e-4).
        density_of: a bucket's last union density, or None (identical on every rank).
        clock: what host trials and steps are timed with (seconds).
        step_check: check a plan that sends buckets through omnireduce on whole steps
            (:mod:`omnireduce.ddp.routing.step_check`), ``trials`` steps of each way.
        paths: the paths measured, in the order a bucket of index 0 takes them (the dense
            all-reduce among them; the others are ways through omnireduce: ``"omnireduce"``, the
            aggregators, and ``"collective"``, the collective engine). A bucket of index ``i``
            starts ``i`` paths later, so that buckets measured together take different paths.
        hierarchy: the hierarchy runs beside the flat path: the step check also times every decided
            bucket through it (``"hier:"`` and its path) and keeps the faster :class:`Span` (see the module).
    """

    def __init__(self, trials: int = 3, warmup: int = 1, remeasure_every: int | None = None, drift: float = 2.0,
                 density_of: Callable[[BucketKey], float | None] = lambda key: None,
                 clock: Callable[[], float] = time.perf_counter, step_check: bool = True,
                 paths: tuple[str, ...] = (Path.of(Way.AGGREGATORS), DENSE), hierarchy: bool = False) -> None:
        if remeasure_every is None:
            remeasure_every = 50 * len(paths) * (warmup + trials)
        if trials < 1 or warmup < 0 or remeasure_every < 0 or drift <= 1.0:
            raise ValueError(f"path choice: trials >= 1, warmup >= 0, remeasure_every >= 0 and drift > 1 expected, "
                             f"got {trials}, {warmup}, {remeasure_every}, {drift}")
        flat = {p for p in Path if not p.hierarchical and not p.whole}
        if DENSE not in paths or len(set(paths)) != len(paths) or len(paths) < 2 or not set(paths) <= flat:
            raise ValueError(f"path choice: paths must be distinct, among {', '.join(sorted(flat))}, with "
                             f"{DENSE.value!r} and one more, got {tuple(map(str, paths))!r}")
        self.paths = tuple(Path(p) for p in paths)
        self.trials, self.warmup, self.remeasure_every, self.drift = trials, warmup, remeasure_every, drift
        self._density_of = density_of  # a bucket's last union density (identical on every rank), or None
        self._clock = clock  # host trials' clock (a test's own, to run the schedule without time)
        self._lock = threading.Lock()  # stats() reads from other threads
        self._buckets: dict[BucketKey, BucketPath] = {}
        self._latest: dict[int, BucketKey] = {}  # bucket index -> its current key (stats)
        self._order: deque[BucketKey] = deque()  # decided buckets, least recently measured first
        self._proposed: list[BucketKey] = []  # the buckets whose medians ride the agreement in flight
        self._next_periodic = remeasure_every
        self._undecided: set[BucketKey] = set()  # buckets measuring or awaiting their agreement
        self._last_measuring = -1  # the last iteration some bucket was measured in
        self.iterations_measuring = 0
        self.step_check = step_check
        self._check_pending = False  # a bucket went (back) to omnireduce since the last step check
        self._check: StepCheck | None = None  # the step check running or awaiting its agreement
        self._check_proposed = False  # its medians ride the agreement in flight
        self._marked = -1  # the iteration whose first bucket was marked last
        self.checks: list[dict[str, object]] = []  # the step checks' outcomes (stats)
        self.hierarchy = hierarchy
        self.span = Span.FLAT  # where decided buckets go (hierarchy: the last step check's choice)
        self._steady: dict[BucketKey, Path] = {}  # the buckets nothing can change this iteration: their paths
        self._steady_at = -1  # the iteration ``_steady`` holds for
        self._called: list[BucketKey] = []  # the steady buckets called in that iteration (recorded at the next mark)

    @property
    def calls_per_measurement(self) -> int:
        return len(self.paths) * (self.warmup + self.trials)

    def ways_of(self, key: BucketKey) -> tuple[Path, ...]:
        """The paths bucket ``key`` is measured on: a compressed bucket's also ``"uncompressed"`` (the
        whole bucket and its residual through the dense all-reduce: the way where compressing does not pay)."""
        return (*self.paths, Path.UNCOMPRESSED) if is_compressed(key) else self.paths

    # -- the hook's questions --------------------------------------------------------------------

    def steady_path(self, key: BucketKey, iteration: int) -> Path | None:
        """The path of bucket ``key`` at ``iteration`` where nothing can change it this iteration (a
        dictionary lookup: decided, or sent dense untimed, neither in a step check nor able to start a
        measurement now: see :meth:`mark`); None: ask :meth:`choose`. Answers only after :meth:`mark`
        of ``iteration``."""
        if iteration != self._steady_at:
            return None
        path = self._steady.get(key)
        if path is not None:
            self._called.append(key)  # (its call, recorded at the next mark: nothing reads it before)
        return path

    def plan(self, iteration: int) -> Mapping[BucketKey, Path]:
        """Every bucket's path that nothing can change at ``iteration`` (what :meth:`steady_path` answers,
        at once, for a caller that routes by it and hands the buckets it routed so to the next
        :meth:`mark`); empty before :meth:`mark` of ``iteration``. Read only."""
        return self._steady if iteration == self._steady_at else {}

    def choose(self, key: BucketKey, iteration: int, buffer: torch.Tensor, density: float | None,
               fallback: Callable[[], Path]) -> tuple[Path, Trial | None]:
        """The path of bucket ``key`` at this call, and the :class:`Trial` to watch when this call is
        a timed one. ``density``: the bucket's last union density (None: unknown); ``fallback``:
        the path while a bucket is waiting for its first decision (the threshold rule)."""
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = BucketPath(key, times_ms=dict.fromkeys(self.ways_of(key)))
                self._undecided.add(key)
            self._latest[key[0]] = key
            b.last_call_iteration = iteration
            if b.phase == DECIDED and self._should_remeasure(b, iteration, density):
                self._start(b, iteration)
            if b.phase == MEASURING:
                return self._measure_call(b, iteration, buffer)
            if b.path is not None:
                check = self._check
                way = check.way_at(iteration, b.key) if check is not None and b.key in check.buckets else None
                return way or self._laid(b.path), None
        return fallback(), None

    def settle(self, key: BucketKey, iteration: int) -> None:
        """Bucket ``key`` goes dense without being measured (the router knows every way through
        omnireduce would carry it by the dense all-reduce whole): reported by :meth:`stats` (phase
        ``"whole"``), never timed, never in a step check."""
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = BucketPath(key, path=dense_way(key), phase=WHOLE, decided_at=iteration)
            self._latest[key[0]] = key
            b.last_call_iteration = iteration

    def mark(self, iteration: int, buffer: torch.Tensor, called: Sequence[BucketKey] = ()) -> None:
        """Called at every bucket, before :meth:`choose`: at an iteration's first, start the step
        check when one is due (every bucket decided), time the check's steps, and find the buckets
        whose path nothing can change this iteration (:meth:`steady_path`, :meth:`plan`).
        ``called``: the buckets a caller routed by :meth:`plan` since the last mark (their calls
        recorded as :meth:`choose` records them)."""
        with self._lock:
            if iteration == self._marked:
                return  # (not the iteration's first bucket)
            self._marked = iteration
            self._called.extend(called)
            self._record_calls()
            if self._check is None and self._check_pending and not self._measuring(iteration):
                self._check_pending = False
                plan = frozenset(k for k, b in self._buckets.items() if b.phase == DECIDED and
                                 (b.path != dense_way(k) or self.hierarchy) and b.last_call_iteration >= iteration - 1)
                if plan:
                    self._check = StepCheck(iteration, plan, self.trials, self._clock, self._variants(plan))
            check = self._check
            if check is not None:
                check.mark(iteration, buffer)
                if check.running(iteration):
                    self._count_measuring(iteration)
            self._steady, self._steady_at = self._steady_paths(iteration), iteration

    def _record_calls(self) -> None:
        """The calls :meth:`steady_path` answered in the iteration it held for, as :meth:`choose` records them."""
        at = self._steady_at
        for key in self._called:
            b = self._buckets[key]
            b.last_call_iteration = max(b.last_call_iteration, at)
            self._latest[key[0]] = key
        self._called = []

    def _steady_paths(self, iteration: int) -> dict[BucketKey, Path]:
        """The decided buckets (and those sent dense untimed) whose path cannot change at ``iteration``:
        none in a step check, and none that could start a measurement now (:meth:`_should_remeasure`,
        asked with each bucket's density; a bucket that could goes through :meth:`choose`, which
        decides as it always has, in DDP's order)."""
        check = self._check
        quiet = self._measuring(iteration) or check is not None or self._check_pending
        steady: dict[BucketKey, Path] = {}
        for key, b in self._buckets.items():
            if b.path is None or (check is not None and key in check.buckets):
                continue
            if b.phase == WHOLE:
                steady[key] = b.path
            elif b.phase == DECIDED and (quiet or not self._should_remeasure(b, iteration, self._density_of(key),
                                                                            log_drift=False)):
                steady[key] = self._laid(b.path)
        return steady

    def _laid(self, path: Path) -> Path:
        """A decided bucket's path in the span chosen (through the hierarchy, or flat)."""
        return path.through_hierarchy() if self.span == Span.HIERARCHICAL else path

    def _variants(self, plan: frozenset[BucketKey]) -> list[dict[BucketKey, Path]]:
        """The step check's ways: the plan, then its buckets dense; with the hierarchy, every bucket through
        the hierarchy, flat (unless that is dense throughout), dense."""
        dense = {k: dense_way(k) for k in plan}
        if not self.hierarchy:
            return [{}, dense]
        flat = {k: self._buckets[k].path or dense_way(k) for k in plan}
        hier = {k: p.through_hierarchy() for k, p in flat.items()}
        return [hier, flat, dense] if flat != dense else [hier, dense]

    def _measuring(self, iteration: int) -> bool:
        """Whether some bucket DDP still calls is being measured or awaits its decision."""
        return any(self._buckets[k].last_call_iteration >= iteration - 1 for k in self._undecided)

    def _count_measuring(self, iteration: int) -> None:
        if iteration != self._last_measuring:  # (iterations only grow)
            self._last_measuring = iteration
            self.iterations_measuring += 1

    def _should_remeasure(self, b: BucketPath, iteration: int, density: float | None, log_drift: bool = True) -> bool:
        if self._measuring(iteration) or self._check is not None or self._check_pending:
            return False  # one bucket at a time (buckets DDP no longer calls do not count), not during a check
        if b.path != dense_way(b.key) and density is not None and b.density_at_decision is not None:
            now, then = max(density, 1e-4), max(b.density_at_decision, 1e-4)
            if now > then * self.drift or now < then / self.drift:
                if not log_drift:
                    return True
                log.info("omnireduce: bucket %d: union density %.4g, was %.4g when decided: measuring again",
                         b.key[0], density, b.density_at_decision)
                return True
        if not self.remeasure_every or iteration < self._next_periodic:
            return False
        while self._order and self._buckets[self._order[0]].last_call_iteration < iteration - 1:
            self._order.popleft()  # a bucket DDP no longer calls (rebuilt): skipped
        return bool(self._order) and self._order[0] == b.key

    def _start(self, b: BucketPath, iteration: int) -> None:
        b.phase, b.calls, b.trials = MEASURING, 0, []
        self._undecided.add(b.key)
        if b.key in self._order:
            self._order.remove(b.key)
        self._next_periodic = iteration + self.remeasure_every

    def _measure_call(self, b: BucketPath, iteration: int, buffer: torch.Tensor) -> tuple[Path, Trial | None]:
        ways = self.ways_of(b.key)
        path = ways[(b.calls + b.key[0]) % len(ways)]  # (staggered by bucket: see the module)
        timed = b.calls >= len(ways) * self.warmup
        b.calls += 1
        self._count_measuring(iteration)
        trial = Trial(path, buffer, self._clock) if timed else None
        if trial is not None:
            b.trials.append(trial)
        if b.calls >= len(ways) * (self.warmup + self.trials):
            b.phase, b.last_trial_iteration = AWAITING, iteration
        return path, trial

    # -- the agreement ---------------------------------------------------------------------------

    def proposal(self, iteration: int) -> list[int]:
        """At the last bucket of ``iteration``: this rank's medians (negated microseconds, 0 when
        unknown) of the buckets whose last trial was in an earlier iteration, one per path per
        bucket, in key order (then the step check's two, when it is done). Every rank proposes the
        same buckets (their schedules are identical)."""
        with self._lock:
            ready = sorted(k for k, b in self._buckets.items()
                           if b.phase == AWAITING and b.last_trial_iteration < iteration and k not in self._proposed)
            self._proposed = ready
            values: list[int] = []
            for k in ready:
                for path in self.ways_of(k):
                    values.append(negated_median_us([s for t in self._buckets[k].trials
                                                     if t.path == path and (s := t.seconds()) is not None]))
            self._check_proposed = self._check is not None and self._check.ready(iteration)
            if self._check_proposed:
                assert self._check is not None
                values += self._check.proposal()  # the plan's steps, then the dense ones
            return values

    def agreed(self, values: list[int], iteration: int) -> None:
        """The all-reduced (MIN) proposal, at the first bucket of ``iteration``: decide each
        proposed bucket from the slowest rank's medians (its union density then is remembered, to
        notice drift)."""
        with self._lock:
            proposed, self._proposed = self._proposed, []
            checked, self._check_proposed = self._check_proposed, False
            per_bucket = [self.ways_of(k) for k in proposed]
            ways = self._check.ways if checked and self._check is not None else 0
            if len(values) != sum(map(len, per_bucket)) + ways:
                raise RuntimeError(f"path choice: {len(values)} values agreed for {len(proposed)} buckets"
                                   + (" and a step check" if checked else ""))
            ms = [-v / 1e3 or None for v in values]
            at = 0
            for k, paths in zip(proposed, per_bucket, strict=True):
                times = dict(zip(paths, ms[at: at + len(paths)], strict=True))
                at += len(paths)
                self._decide(self._buckets[k], times, iteration, self._density_of(k))
            if checked:
                self._conclude_check(ms[len(ms) - ways:], iteration)

    def _decide(self, b: BucketPath, times: dict[Path, float | None], iteration: int, density: float | None) -> None:
        path = fastest(times)
        changed = path != b.path
        if (path != dense_way(b.key) or self.hierarchy) and (changed or b.vetoed):
            self._check_pending = self.step_check  # a new plan: check it on whole steps
        b.path, b.phase, b.decided_at, b.trials, b.vetoed = path, DECIDED, iteration, [], False
        self._undecided.discard(b.key)
        b.times_ms = dict(times)
        b.density_at_decision = density
        b.measurements += 1
        self._order.append(b.key)
        level = logging.INFO if changed or b.measurements == 1 else logging.DEBUG
        log.log(level, "omnireduce: bucket %d (%d elements) goes %s from iteration %d: %s (slowest rank's median "
                "of %d), union density %s", b.key[0], b.key[1], path, iteration,
                ", ".join(f"{p} {_ms(t)}" for p, t in times.items()), self.trials,
                "unknown" if density is None else f"{density:.4g}")

    def _conclude_check(self, medians: list[float | None], iteration: int) -> None:
        """Apply the check's winner (see :meth:`StepCheck.winner`): the plan stays (with the hierarchy: in the
        hierarchy or flat), or its omnireduce buckets go dense (vetoed)."""
        check, self._check = self._check, None
        assert check is not None
        won = StepCheck.winner(medians)
        dense = won == check.ways - 1
        buckets = sorted(k for k in check.buckets if k in self._buckets)
        if dense:
            for k in buckets:
                b = self._buckets[k]
                if b.phase == DECIDED and b.path != dense_way(k):
                    b.path, b.vetoed, b.decided_at = dense_way(k), True, iteration
        checked = [k[0] for k in buckets]
        entry: dict[str, object] = {"at": iteration, "buckets": checked, "plan_ms": medians[0],
                                    "dense_ms": medians[-1], "kept": not dense}
        flat_ms, chosen = medians[0], ""
        if self.hierarchy:
            self.span = Span.HIERARCHICAL if won == 0 else Span.FLAT
            flat_ms, chosen = medians[1] if check.ways == 3 else medians[-1], "dense" if dense else str(self.span)
            entry.update(hierarchical_ms=medians[0], plan_ms=flat_ms, chosen=chosen)
        self.checks.append(entry)
        log.info("omnireduce: step check: steps with bucket(s) %s %s, dense %s (slowest rank's median of %d): "
                 "%s from iteration %d", checked,
                 f"through the hierarchy {_ms(medians[0])}, flat {_ms(flat_ms)}" if self.hierarchy
                 else f"through omnireduce {_ms(medians[0])}", _ms(medians[-1]), check.trials,
                 chosen if self.hierarchy else "they stay on omnireduce" if not dense else "they go dense",
                 iteration)

    # -- reporting -------------------------------------------------------------------------------

    def check_stats(self) -> list[dict[str, object]]:
        """The step checks so far: the iteration each concluded at, the buckets checked, the agreed
        step medians of the plan and with them dense (ms), and whether the plan was kept."""
        with self._lock:
            return [dict(c) for c in self.checks]

    def stats(self) -> dict[int, dict[str, object]]:
        """Per bucket index (its current key): path, phase, the agreed times of both paths in ms,
        the iteration the decision applied from, the measurements made (plain values only)."""
        with self._lock:
            out = {}
            for i, k in sorted(self._latest.items()):
                b = self._buckets[k]
                out[i] = b.report(self._laid(b.path) if b.path is not None and b.phase == DECIDED else b.path)
            return out


def _ms(value: float | None) -> str:
    return "not timed" if value is None else f"{value:.3g} ms"
