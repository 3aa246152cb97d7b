"""The broker's Prometheus metrics, every one defined here (``GET /metrics``, docs/operations.md).

Two kinds, by where the truth lives:

* **Read from Redis at scrape time** (``StoreCollector``): jobs by state and team, the queue and
  its oldest wait, GPUs per pool, GPU-seconds and cost per team and pool (spot and on-demand,
  with what the same GPUs would have cost on on-demand), preemptions and migrations per region,
  leader changes. Every replica computes them from the shared state, so any replica a scrape
  reaches serves the same numbers, and they survive broker restarts. The counters among them
  only grow because the state they sum only grows: closed placement intervals (an open one is
  a gauge until it closes, since it may close at a recorded end before the last scrape), the
  per-pool counts and the fence. A series, once served, is served from then on (zero when
  nothing is left in it), so dashboards and alerts see a zero rather than an absence.
* **Observed in this process** (module-level instruments in ``EVENTS``): scheduling-round and
  allocator-solve durations and the queue wait of each job's first launch (the leader),
  provider errors by kind (the leader's actuator), and checkpoint durations and sizes (the
  agents' reports this replica took). Sum them over replicas in PromQL.

Names follow the Prometheus rules: one ``fleet_`` prefix, base units (``_seconds``, ``_bytes``,
``_usd``), counters end in ``_total``, and no label takes unbounded values (no job ids): labels
are teams, pools and their coordinates, states and error kinds.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from broker.costs import interval_cost
from broker.models import TERMINAL_STATES, JobState, Placement
from broker.store import MIGRATIONS_KEY, PREEMPTIONS_KEY, Store
from policies.models import Pool
from providers.base import CapacityError, QuotaError

log = logging.getLogger(__name__)
PREFIX = "fleet_"
# No "<name>_created" companion series: Prometheus does not use them in the text format, and
# each would double the broker's series.
disable_created_metrics()
EVENTS = CollectorRegistry()

ROUND_SECONDS = Histogram(
    "fleet_scheduling_round_duration_seconds",
    "Wall time of one scheduling round on the leader (snapshot, plan, atomic write)",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=EVENTS)
SOLVE_SECONDS = Histogram(
    "fleet_allocator_solve_duration_seconds",
    "Time the elastic DP allocator took in one scheduling round (all accelerator types)",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
    registry=EVENTS)
PROVIDER_ERRORS = Counter(
    "fleet_provider_errors",
    "Provider calls that failed, by cloud and kind (capacity, quota, other)",
    ["cloud", "kind"], registry=EVENTS)
QUEUE_WAIT_SECONDS = Histogram(
    "fleet_queue_wait_seconds",
    "Time from a job's submission to its first launch (its nodes up), by team, observed by "
    "the leader when the job first runs",
    ["team"],
    buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600,
             86400),
    registry=EVENTS)
CHECKPOINT_SECONDS = Histogram(
    "fleet_checkpoint_duration_seconds",
    "Time to write and commit one checkpoint, as the job's agent reported it",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
    registry=EVENTS)
CHECKPOINT_BYTES = Histogram(
    "fleet_checkpoint_size_bytes",
    "Size of one committed checkpoint (every rank's files and the manifest), as reported",
    buckets=tuple(float(4**k) * 2**20 for k in range(9)),  # 1 MiB to 64 GiB by powers of 4
    registry=EVENTS)

# The states whose jobs wait for GPUs (the queue): never started, or suspended off GPUs.
WAITING = (JobState.QUEUED.value, JobState.SUSPENDED.value)
HOLDING = tuple(s.value for s in JobState if s.holds_gpus)
TERMINAL = frozenset(s.value for s in TERMINAL_STATES)

# The store's index, read-only and in one step (a consistent view): each active job's id and
# version, each finished state's size, the pools, the per-pool counts, the fence and the lease.
# ARGV: prefix, preemptions key, migrations key, n, n active states, the finished states.
INDEX = """
local p, n = ARGV[1], tonumber(ARGV[4])
local active, finished = {}, {}
for i = 5, 4 + n do
  for _, id in ipairs(redis.call('SMEMBERS', p .. 'state:' .. ARGV[i])) do
    active[#active + 1] = id
    active[#active + 1] = redis.call('HGET', p .. 'job:' .. id, 'version') or '0'
  end
end
for i = 5 + n, #ARGV do finished[#finished + 1] = redis.call('SCARD', p .. 'state:' .. ARGV[i]) end
return {active, finished, redis.call('HVALS', p .. 'pools'), redis.call('HGETALL', p .. ARGV[2]),
        redis.call('HGETALL', p .. ARGV[3]), redis.call('GET', p .. 'fence') or '0',
        redis.call('GET', p .. 'leader') or ''}
"""
ACTIVE = tuple(s.value for s in JobState if s not in TERMINAL_STATES)
FINISHED = tuple(s.value for s in JobState if s in TERMINAL_STATES)


def pool_labels(pool_id: str) -> tuple[str, str, str, str]:
    """``(cloud, region, market, accelerator)`` of a pool id ``cloud:region[/zone]:market:acc``
    (the zone is dropped: per-region series sum a region's zones)."""
    parts = pool_id.split(":")
    if len(parts) < 4:
        return (parts[0] if parts else "", "", "", "")
    cloud, market, acc = parts[0], parts[-2], parts[-1]
    region = ":".join(parts[1:-2]).split("/", 1)[0]
    return cloud, region, market, acc


def provider_error(cloud: str, exc: BaseException) -> None:
    """Count a failed provider call (``fleet_provider_errors_total``)."""
    kind = "capacity" if isinstance(exc, CapacityError) else \
        "quota" if isinstance(exc, QuotaError) else "other"
    PROVIDER_ERRORS.labels(cloud=cloud, kind=kind).inc()


def first_launch(team: str, waited_s: float) -> None:
    """Observe a job's wait from submission to its first launch (``fleet_queue_wait_seconds``)."""
    QUEUE_WAIT_SECONDS.labels(team=team).observe(max(0.0, waited_s))


class CheckpointReports:
    """Feeds the checkpoint histograms from agents' heartbeats, once per checkpoint written: a
    heartbeat repeats the newest committed checkpoint until the next one, so each job's last
    observed ``(attempt, step)`` is remembered (the ``limit`` most recent jobs: a bound on
    memory). A checkpoint reported without its write time is one the attempt loaded, not
    wrote: not observed again."""

    def __init__(self, limit: int = 50_000) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, job_id: str, attempt: int, step: int | None, size: int | None,
                seconds: float | None) -> bool:
        """Observe a reported checkpoint if it is new; returns whether it was."""
        if step is None or seconds is None:
            return False
        with self._lock:
            if self._seen.get(job_id) == (attempt, step):
                return False
            self._seen[job_id] = (attempt, step)
            self._seen.move_to_end(job_id)
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
        if size is not None:
            CHECKPOINT_BYTES.observe(size)
        CHECKPOINT_SECONDS.observe(seconds)
        return True


# Labels of the cost counters: team, cloud, region, market, accelerator.
CostKey = tuple[str, ...]
Sums = dict[CostKey, list[float]]  # -> [GPU-seconds, cost USD, on-demand cost USD]


@dataclass(frozen=True)
class _Active:
    """What a scrape needs of one active job at one version of its record."""

    version: str
    team: str
    state: str
    pool: str | None  # where it holds GPUs (launching, running, stopping)
    gpus: int
    since: float  # a waiting job: since when it waits
    closed: Sums  # its closed placement intervals, summed
    open: tuple[Placement, ...]  # its open intervals (cost grows until they close)


class StoreCollector(Collector):
    """The metrics read from Redis at each scrape (see the module's docstring).

    A scrape costs little beyond the active jobs' ids and versions: what it needs of a job is
    kept in this process per record version (a job's placement intervals open and close only
    in the same atomic step as a change of its record), and a finished job, which changes no
    more, is folded into per-team sums once; a finished state's members are read again only
    when its size changed."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._index = store.r.register_script(INDEX)
        self._lock = threading.Lock()  # scrapes may come concurrently (API worker threads)
        self._active: dict[str, _Active] = {}
        self._seen_size: dict[str, int] = {}  # finished state -> its size when last read
        self._settled: set[str] = set()  # finished jobs folded into the two sums below
        self._unsettled: set[str] = set()  # finished jobs with an interval left open
        self._finished_jobs: dict[tuple[str, str], int] = defaultdict(int)  # (state, team)
        self._finished_cost: Sums = defaultdict(_zero)
        # counter family -> labels -> the value last served (``_monotonic``)
        self._served: dict[str, dict[tuple[str, ...], float]] = defaultdict(dict)

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: that would read Redis

    def warm(self) -> None:
        """Read every job now, as a fresh process's first scrape would, so that scrape reads
        only what changed since (an API warms its collector before it serves)."""
        with self._lock:
            self._read()

    def _read(self) -> tuple[list[str], list[str], list[str], str, str,
                             list[tuple[str, str, list[Placement]]]]:
        """Bring the per-job view up to date; returns the index's pools, per-pool preemption
        and migration counts, fence and leader, and the unsettled finished jobs."""
        active, sizes, pools, preempted, migrated, fence, leader = self._index(
            args=[self.store.p, PREEMPTIONS_KEY, MIGRATIONS_KEY, len(ACTIVE), *ACTIVE,
                  *FINISHED])
        self._refresh(dict(zip(active[::2], active[1::2], strict=True)))
        unsettled = self._finish(dict(zip(FINISHED, (int(x) for x in sizes), strict=True)))
        return pools, preempted, migrated, fence, leader, unsettled

    def collect(self) -> Iterator[Metric]:
        with self._lock:  # the served values (``_monotonic``) change under it too
            families = list(self._collect())
        return iter(families)

    def _collect(self) -> Iterator[Metric]:
        pools, preempted, migrated, fence, leader, unsettled = self._read()
        jobs = dict(self._finished_jobs)
        closed: Sums = {k: list(v) for k, v in self._finished_cost.items()}
        accruing: Sums = {}
        now = time.time()
        for state, team, ps in unsettled:
            jobs[state, team] = jobs.get((state, team), 0) + 1
            _add(closed, team, [x for x in ps if x.end is not None])
            _add(accruing, team, [x for x in ps if x.end is None])
        queue: dict[str, int] = defaultdict(int)
        oldest: dict[str, float] = defaultdict(float)
        held: dict[str, int] = defaultdict(int)
        for e in self._active.values():
            jobs[e.state, e.team] = jobs.get((e.state, e.team), 0) + 1
            if e.state in WAITING:
                queue[e.team] += 1
                oldest[e.team] = max(oldest[e.team], now - e.since)
            elif e.pool is not None:
                held[e.pool] += e.gpus
            for key, sums in e.closed.items():
                _plus(closed.setdefault(key, _zero()), sums)
            _add(accruing, e.team, e.open)

        teams = sorted({team for _, team in jobs})
        g = GaugeMetricFamily(f"{PREFIX}jobs", "Jobs in the store by state and team (0 for a "
                              "state no job of a known team is in)", labels=["state", "team"])
        for team in teams:
            for state in JobState:
                g.add_metric([state.value, team], jobs.get((state.value, team), 0))
        yield g
        q = GaugeMetricFamily(f"{PREFIX}queue_jobs", "Jobs waiting for GPUs (queued or "
                              "suspended) by team", labels=["team"])
        w = GaugeMetricFamily(f"{PREFIX}queue_oldest_wait_seconds", "How long the longest-"
                              "waiting job of a team has waited (since submission, or since "
                              "its suspension; 0 with none waiting)", labels=["team"])
        for team in teams:
            q.add_metric([team], queue[team])
            w.add_metric([team], max(0.0, oldest[team]))
        yield q
        yield w
        yield from _pools(pools, held)
        yield from self._costs(closed, accruing)
        for name, doc, counts in (
                ("preemptions", "Spot preemptions the broker handled, by region", preempted),
                ("migrations", "Jobs moved out of a region to another pool, by source region",
                 migrated)):
            per_region: dict[tuple[str, ...], float] = defaultdict(float)
            for pool_id, n in zip(counts[::2], counts[1::2], strict=True):
                cloud, region, _, _ = pool_labels(pool_id)
                per_region[cloud, region] += float(n)
            yield self._counter(name, doc, ["cloud", "region"], per_region)
        yield self._counter("leader_changes", "Times a broker replica took the leader lease "
                            "(the fencing token: it grows by one per holder)", [],
                            {(): float(fence)})
        g = GaugeMetricFamily(f"{PREFIX}leader_lease_held", "1 while a broker replica holds "
                              "the leader lease")
        g.add_metric([], 1.0 if leader else 0.0)
        yield g

    def _costs(self, closed: Sums, accruing: Sums) -> Iterator[Metric]:
        """The cost counters (closed intervals) and, on the same series, the gauges of what is
        still accruing: ``counter + gauge`` is the spend so far, as ``GET /v1/costs`` gives it."""
        labels = ["team", "cloud", "region", "market", "accelerator"]
        keys = closed.keys() | accruing.keys()
        for k, (name, what) in enumerate((
                ("gpu_seconds", "GPU-seconds jobs held"),
                ("cost_usd", "What jobs cost"),
                ("ondemand_cost_usd", "What the same GPU time would have cost on on-demand "
                 "(the saving is this minus the cost)"))):
            served = self._monotonic(name, {key: closed.get(key, _zero())[k] for key in keys})
            c = CounterMetricFamily(
                f"{PREFIX}{name}", f"{what} in placement intervals that closed, by team and "
                "pool; an interval counts when it closes, at its recorded end (until then "
                f"it is in {PREFIX}open_{name})", labels=labels)
            g = GaugeMetricFamily(
                f"{PREFIX}open_{name}", f"{what} so far in placement intervals still open "
                f"(until now), by team and pool; each moves into {PREFIX}{name}_total when it "
                "closes", labels=labels)
            for key in sorted(served):
                c.add_metric(list(key), served[key])
                g.add_metric(list(key), accruing.get(key, _zero())[k])
            yield c
            yield g

    def _counter(self, name: str, doc: str, labels: list[str],
                 values: Mapping[tuple[str, ...], float]) -> CounterMetricFamily:
        c = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=labels)
        for key, value in sorted(self._monotonic(name, values).items()):
            c.add_metric(list(key), value)
        return c

    def _monotonic(self, name: str, values: Mapping[tuple[str, ...], float],
                   ) -> dict[tuple[str, ...], float]:
        """Counter ``name``'s series to serve: each at least what it was last served, and every
        series served before still there. What they sum only grows, but floating-point sums
        taken in another order (a job moving from the active jobs into the finished sums) may
        come out a rounding error lower, which Prometheus would read as a counter reset."""
        served = self._served[name]
        for key, value in values.items():
            served[key] = max(served.get(key, value), value)
        return dict(served)

    def _refresh(self, versions: dict[str, str]) -> None:
        """Keep ``_active`` to the active jobs at their current versions, reading a job's
        record and intervals (in one MULTI: the same version of both) only when it changed."""
        for gone in self._active.keys() - versions.keys():
            del self._active[gone]
        changed = [i for i, v in versions.items()
                   if (e := self._active.get(i)) is None or e.version != v]
        pipe = self.store.r.pipeline(transaction=True)
        for job_id in changed:
            pipe.hmget(f"{self.store.p}job:{job_id}", "doc", "state", "team", "version")
            pipe.lrange(f"{self.store.p}placements:{job_id}", 0, -1)
        raw = pipe.execute() if changed else []
        for job_id, (doc, state, team, version), intervals in zip(
                changed, raw[::2], raw[1::2], strict=True):
            if doc is None or state in TERMINAL:
                continue  # gone or finished since the index was read: not active
            record = json.loads(doc)
            ps = [Placement.model_validate_json(x) for x in intervals]
            closed: Sums = defaultdict(_zero)
            _add(closed, team, [x for x in ps if x.end is not None])
            self._active[job_id] = _Active(
                version=version, team=team, state=state,
                pool=record.get("pool") if state in HOLDING else None,
                gpus=int(record.get("gpus") or 0),
                since=float(record.get("submitted_at") if state == JobState.QUEUED.value
                            else record.get("updated_at") or 0.0),
                closed=dict(closed), open=tuple(x for x in ps if x.end is None))

    def _finish(self, sizes: dict[str, int]) -> list[tuple[str, str, list[Placement]]]:
        """Fold newly finished jobs into the finished sums; returns the finished jobs left
        with an open interval (a broker stopped while settling them), counted per scrape."""
        new: dict[str, str] = {}
        for state, size in sizes.items():
            if self._seen_size.get(state) != size:
                members = self.store.r.smembers(f"{self.store.p}state:{state}")
                new |= dict.fromkeys(members - self._settled, state)
                self._seen_size[state] = size
        new |= {i: s for i, s in self._unsettled_states().items() if i not in new}
        if not new:
            return []
        ids = list(new)
        pipe = self.store.r.pipeline(transaction=False)  # finished records change no more
        for job_id in ids:
            pipe.hget(f"{self.store.p}job:{job_id}", "team")
        teams = pipe.execute()
        placements = self.store.placements_of(ids)
        left: list[tuple[str, str, list[Placement]]] = []
        self._unsettled = set()
        for job_id, team in zip(ids, teams, strict=True):
            ps = placements[job_id]
            if any(x.end is None for x in ps):
                self._unsettled.add(job_id)
                left.append((new[job_id], team, ps))
                continue
            self._settled.add(job_id)
            self._finished_jobs[new[job_id], team] += 1
            _add(self._finished_cost, team, ps)
        return left

    def _unsettled_states(self) -> dict[str, str]:
        if not self._unsettled:
            return {}
        pipe = self.store.r.pipeline(transaction=False)
        ids = list(self._unsettled)
        for job_id in ids:
            pipe.hget(f"{self.store.p}job:{job_id}", "state")
        return {i: s for i, s in zip(ids, pipe.execute(), strict=True) if s in TERMINAL}


def _zero() -> list[float]:
    return [0.0, 0.0, 0.0]


def _plus(into: list[float], add: list[float]) -> None:
    for k, v in enumerate(add):
        into[k] += v


def _add(into: Sums, team: str, placements: Iterable[Placement]) -> None:
    """Add intervals (an open one: until now) to the per (team, pool coordinates) sums."""
    for p in placements:
        gpu_hours, cost, ondemand = interval_cost(p)
        _, region, _, acc = pool_labels(p.pool)
        _plus(into.setdefault((team, p.cloud, region, p.market.value, acc), _zero()),
              [gpu_hours * 3600.0, cost, ondemand])


def _pools(pools: list[str], held: dict[str, int]) -> Iterator[Metric]:
    labels = ["pool", "cloud", "region", "market", "accelerator"]
    cap = GaugeMetricFamily(f"{PREFIX}pool_gpus", "GPUs a pool offers now", labels=labels)
    alloc = GaugeMetricFamily(f"{PREFIX}pool_gpus_allocated", "GPUs of a pool held by jobs "
                              "(launching, running or stopping)", labels=labels)
    free = GaugeMetricFamily(f"{PREFIX}pool_gpus_free", "GPUs of a pool no job holds",
                             labels=labels)
    # per GPU-second, the base unit (the catalog's prices are per GPU-hour): multiply by 3600
    price = GaugeMetricFamily(f"{PREFIX}pool_price_usd_per_gpu_second", "A pool's price per "
                              "GPU-second now (times 3600: per GPU-hour)", labels=labels)
    for pool in sorted((Pool.model_validate_json(v) for v in pools), key=lambda x: x.id):
        values = [pool.id, pool.cloud, pool.region, pool.market.value, pool.accelerator.value]
        busy = held.get(pool.id, 0)
        cap.add_metric(values, pool.capacity)
        alloc.add_metric(values, busy)
        free.add_metric(values, max(0, pool.capacity - busy))
        price.add_metric(values, pool.price_per_gpu_hour / 3600.0)
    yield from (cap, alloc, free, price)


class _Events(Collector):
    """This process's observed instruments, in a per-app registry beside a ``StoreCollector``."""

    def collect(self) -> Iterator[Metric]:
        return EVENTS.collect()


def registry(store: Store) -> tuple[CollectorRegistry, Callable[[], None]]:
    """A registry for one API app (the store's metrics and this process's instruments), and
    the function that warms it, which the app calls as it starts: it reads every job's record
    and intervals once (``StoreCollector.warm``), or else the first scrape does (0.5 s with
    10,000 jobs, where later ones read what changed). Building the registry reads nothing."""
    collector = StoreCollector(store)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    reg.register(_Events())

    def warm() -> None:
        try:
            collector.warm()
        except RedisError as exc:  # an API starts without Redis (/readyz says so)
            log.warning("metrics not warmed, the first scrape reads every job: %s", exc)

    return reg, warm
