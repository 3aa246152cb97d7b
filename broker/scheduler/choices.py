"""What a job can be given: its fitted model (``policies.job_model``), each GPU count's best
batch size and value on each accelerator type, and the pools and types its spec lets it use."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.models import JobRecord, JobState
from broker.scheduler.config import Policy, SchedulerConfig
from broker.waiting import Needs, unusable_reason
from policies.apps import APP_SPECS, Application
from policies.elastic_dp import Choice
from policies.job_model import (
    GenericPrior,
    JobModel,
    Measurement,
    Prior,
    TablePrior,
    fit,
    measurements,
)
from policies.models import Accelerator, JobSpec, Pool
from policies.throughput import batch_candidates
from providers.measurements import load_application


@functools.cache
def _application(name: str) -> Application | None:
    """The measured tables of a model the spec names (``policies.apps``), else None."""
    return load_application(name) if name in APP_SPECS else None


def _pool_accelerator(pool_id: str | None) -> Accelerator | None:
    """The accelerator of a pool id (``cloud:region[/zone]:market:accelerator``)."""
    try:
        return Accelerator(pool_id.rsplit(":", 1)[1]) if pool_id else None
    except (IndexError, ValueError):
        return None


def job_accelerator(job: JobRecord) -> Accelerator:
    """The type a job runs (or last ran) on, else the first its spec accepts."""
    return _pool_accelerator(job.pool) or job.spec.accelerators[0]


@dataclass
class _Memo:
    """What the round derives from one job record: its fitted model, its best rate on one GPU
    of each type and its choice tables. Kept per record (a round asks for them thousands of
    times, and the store hands out the same record object while the job is unchanged)."""

    job: JobRecord
    inputs: tuple
    model: JobModel
    one_gpu: dict[tuple[Accelerator, bool], float] = field(default_factory=dict)
    tables: dict[tuple, tuple[Choice, ...]] = field(default_factory=dict)


_MEMOS: dict[int, _Memo] = {}


def _memo(job: JobRecord) -> _Memo:
    inputs = (job.pool, job.samples_done, job.measured_gpus, job.measured_batch_size,
              job.samples_per_sec, job.grad_noise_scale, tuple(job.measured.items()))
    hit = _MEMOS.get(id(job))
    if hit is not None and hit.job is job and hit.inputs == inputs:
        return hit
    if len(_MEMOS) > 200_000:  # records the store no longer hands out
        _MEMOS.clear()
    hit = _MEMOS[id(job)] = _Memo(job, inputs, _job_model(job))
    return hit


def job_model(job: JobRecord) -> JobModel:
    """The job's model (``policies.job_model``): the measured tables of ``spec.model`` at the
    job's epoch, else the generic prior, fitted to what its agent measured on the type it ran
    on (:func:`job_accelerator`)."""
    return _memo(job).model


def _job_model(job: JobRecord) -> JobModel:
    spec = job.spec
    app = _application(spec.model) if spec.model else None
    epoch = app.efficiency.epoch(job.samples_done / app.init_batch_size) if app else None
    accel = job_accelerator(job)
    seen = measurements(job.measured, accel)
    if not seen and job.measured_gpus and job.measured_batch_size and job.samples_per_sec:
        seen = ((job.measured_gpus, job.measured_batch_size, job.samples_per_sec),)
    return _fitted(spec.model if app else None, epoch, spec.batch_size.per_gpu_max,
                   spec.batch_size.initial, job.grad_noise_scale, seen, accel)


@functools.lru_cache(maxsize=65_536)
def _fitted(model: str | None, epoch: int | None, per_gpu_max: int | None, init: int,
            noise: float | None, seen: tuple[Measurement, ...],
            accelerator: Accelerator | None) -> JobModel:
    """Jobs alike in these share one model: its prior, fitted to what was measured."""
    generic = GenericPrior(per_gpu_max=per_gpu_max, init_batch=init,
                           noise=noise / init if noise else math.inf)
    prior: Prior = generic
    if model is not None and epoch is not None:
        app = _application(model)
        assert app is not None
        prior = TablePrior(app.name, epoch, app, generic)
    return fit(prior, seen, accelerator, bool(noise))


def samples_per_sec(job: JobRecord, gpus: int, batch: int,
                    accelerator: Accelerator | None = None) -> float:
    """The scheduler's estimate of ``job``'s useful samples/s at ``gpus`` GPUs of
    ``accelerator`` (default: :func:`job_accelerator`) and global ``batch``."""
    return job_model(job).rate(accelerator or job_accelerator(job), gpus, batch)


def job_choices(job: JobRecord, policy: Policy, max_gpus: int,
                accelerator: Accelerator | None = None, base: float | None = None,
                exponent: float = 1.0) -> list[Choice]:
    """Each GPU count's best batch size on ``accelerator`` and its value: the speed-up over
    ``base`` samples/s (default: the job's best on one GPU of that type) to the power
    ``exponent`` (``SchedulerConfig.speedup_exponent``), weighted by priority. A job whose
    agent reported ``even_batch`` (a framework integration that refuses a global batch the
    world size does not divide) is offered only batches that count divides."""
    spec = job.spec
    fixed = policy is not Policy.ELASTIC or spec.batch_mode.value == "fixed"
    lo, hi = spec.gpus.min, min(spec.gpus.max, max_gpus)
    if policy is Policy.STATIC:
        hi = min(hi, lo)
    accelerator = accelerator or job_accelerator(job)
    memo = _memo(job)
    even = job.even_batch is True
    key = (lo, hi, fixed, even, accelerator, base, exponent)
    if (table := memo.tables.get(key)) is None:
        b = spec.batch_size
        table = memo.tables[key] = _choice_table(lo, hi, b.min, b.max, b.initial, fixed, even,
                                                 spec.priority, memo.model, accelerator, base,
                                                 exponent)
    return list(table)


def one_gpu_rate(job: JobRecord, accelerator: Accelerator, fixed: bool = False) -> float:
    """The job's best useful samples/s on one GPU of ``accelerator``."""
    memo = _memo(job)
    if (rate := memo.one_gpu.get((accelerator, fixed))) is None:
        b = job.spec.batch_size
        rate = memo.one_gpu[accelerator, fixed] = _one_gpu(memo.model, accelerator, b.min,
                                                           b.max, b.initial, fixed)
    return rate


def _batches(bmin: int, bmax: int, binit: int, fixed: bool, gpus: int,
             even: bool = False) -> list[int]:
    """The global batches worth trying on ``gpus`` GPUs, each at least one sample per GPU;
    ``even``: only multiples of ``gpus`` (each candidate rounded down to one, those left in
    the job's range), as an integration that averages equal micro-batches runs no other."""
    if fixed:
        return [binit] if binit >= gpus and not (even and binit % gpus) else []
    out = batch_candidates(bmin, bmax, gpus)
    if even:
        out = sorted({y for x in out if (y := x - x % gpus) >= bmin})
    return out


@functools.lru_cache(maxsize=65_536)
def _one_gpu(model: JobModel, accelerator: Accelerator, bmin: int, bmax: int, binit: int,
             fixed: bool) -> float:
    return max((model.rate(accelerator, 1, x) for x in _batches(bmin, bmax, binit, fixed, 1)),
               default=0.0) or model.rate(accelerator, 1, binit)


@functools.lru_cache(maxsize=65_536)
def _choice_table(lo: int, hi: int, bmin: int, bmax: int, binit: int, fixed: bool,
                  even: bool, priority: int, model: JobModel, accelerator: Accelerator,
                  base: float | None, exponent: float) -> tuple[Choice, ...]:
    """Choices depend only on these numbers; jobs of the same shape share one table."""
    base = base or _one_gpu(model, accelerator, bmin, bmax, binit, fixed)
    if not base > 0:
        return ()
    weight = 2.0 ** (priority / 25.0)
    out = []
    for g in range(lo, hi + 1):
        options = _batches(bmin, bmax, binit, fixed, g, even)
        if not options:
            continue
        rates = {x: model.rate(accelerator, g, x) for x in options}
        best = max(options, key=rates.__getitem__)
        if rates[best] > 0:
            out.append(Choice(g, best, weight * (rates[best] / base) ** exponent))
    return tuple(out)


class UsablePools:
    """The pools each job's needs let it use, looked up once per round per distinct needs (many
    jobs share them)."""

    def __init__(self, pools: Sequence[Pool], room: Mapping[str, int] | None = None) -> None:
        self.live = [p for p in pools if p.capacity > 0]  # a pool reclaimed whole hosts none
        self.room = room or {}
        self._memo: dict[Needs, list[Pool]] = {}
        self._of_spec: dict[int, tuple[JobSpec, list[Pool]]] = {}  # the same spec, asked again
        self._sizes: dict[tuple, tuple[int, frozenset[int], frozenset[int]]] = {}

    def __call__(self, spec: JobSpec) -> list[Pool]:
        """Pools with GPUs that meet the job's needs (``broker.waiting.Needs``: its
        accelerators, regions, spot setting and, for a fixed node count, its share per node)."""
        if (seen := self._of_spec.get(id(spec))) is not None and seen[0] is spec:
            return seen[1]
        needs = Needs.of(spec)
        if (hit := self._memo.get(needs)) is None:
            hit = self._memo[needs] = [p for p in self.live if needs.unmet(p) is None]
        self._of_spec[id(spec)] = (spec, hit)
        return hit

    def why_none(self, spec: JobSpec) -> tuple[str, str]:
        """The event and reason of a job none of the round's pools with GPUs may host."""
        return unusable_reason(spec, self.live)

    def sizes(self, spec: JobSpec, accel: Accelerator,
              ) -> tuple[int, frozenset[int], frozenset[int]]:
        """Of the job's pools of ``accel``: the largest capacity, the GPU counts one of them
        can launch with its ``room`` this round, and those one of them can launch at all."""
        pools = self(spec)
        key = (id(pools), accel)
        if (hit := self._sizes.get(key)) is None:
            mine = [p for p in pools if p.accelerator is accel]
            top = max((p.capacity for p in mine), default=0)
            held = frozenset(g for g in range(1, top + 1) if any(p.launchable(g) for p in mine))
            roomy = frozenset(g for g in held if any(
                p.launchable(g) and self.room.get(p.id, 0) >= g for p in mine))
            hit = self._sizes[key] = (top, roomy, held)
        return hit


def offered_types(job: JobRecord, usable: UsablePools) -> list[Accelerator]:
    """The types a job may be given: the one it runs on, else those of its accelerators that
    a pool in its regions offers, in the spec's order."""
    if job.state is JobState.RUNNING and (accel := _pool_accelerator(job.pool)) is not None:
        return [accel]
    offered = {p.accelerator for p in usable(job.spec)}
    return [a for a in job.spec.accelerators if a in offered]


def type_choices(job: JobRecord, accel: Accelerator, usable: UsablePools,
                 config: SchedulerConfig,
                 alike: dict[tuple, tuple[Choice, ...]] | None = None) -> list[Choice]:
    """The job's choices on ``accel``: GPU counts one of its pools of that type can host (its
    room this round, ``UsablePools.room``, a running job's own GPUs counted free) and launch (a
    cloud's instance sizes: an 8-GPU instance type does not make 2 GPUs launchable), each valued
    as the speed-up over one GPU of the slowest type the job accepts, so values compare across
    types. Where no pool has room for any size, the sizes its pools hold at all (placement then
    says why the job waits). ``alike`` (one round's) holds the answer for jobs of the same
    shape: a round asks for thousands of jobs, most of them alike, and one new record each."""
    spec = job.spec
    top, roomy, held = usable.sizes(spec, accel)
    if not top:
        return []
    memo = _memo(job)
    fixed = config.policy is not Policy.ELASTIC or spec.batch_mode.value == "fixed"
    b = spec.batch_size
    # everything the answer depends on; the pools' sizes are the same objects for jobs alike
    key = (memo.model, accel, tuple(spec.accelerators), spec.gpus.min, spec.gpus.max, b.min,
           b.max, b.initial, spec.priority, fixed, job.even_batch is True, top, roomy, held)
    if alike is not None and (hit := alike.get(key)) is not None:
        return list(hit)
    base = min((x for a in spec.accelerators if (x := one_gpu_rate(job, a, fixed)) > 0),
               default=None)
    opts = job_choices(job, config.policy, top, accel, base, config.speedup_exponent)
    # no room anywhere now: sizes a pool holds at all, so placement can say why it waits
    out = tuple(c for c in opts if c.gpus in roomy) or tuple(c for c in opts if c.gpus in held)
    if alike is not None:
        alike[key] = out
    return list(out)
