"""A job's model fitted online (``policies.job_model``): a job that names a measured model starts
from its table; one that does not starts from the generic prior and converges to its table as it
reports configurations; measured configurations are predicted as measured."""

from __future__ import annotations

import numpy as np
import pytest

from broker.models import JobRecord
from broker.scheduler import job_model, samples_per_sec
from policies.job_model import GenericPrior, TablePrior, fit
from policies.models import Accelerator, BatchRange, GpuRange, JobSpec
from policies.throughput import ThroughputModel
from providers.measurements import load_application

T4 = Accelerator.T4
APP = load_application("cifar10")
TABLE = TablePrior("cifar10", 0, APP)
M0 = APP.init_batch_size
# configurations a job of cifar10 runs in on T4 nodes of 4 GPUs (GPUs, global batch)
GRID = [(g, b) for g in (1, 2, 4, 8, 16) for b in (M0, 2 * M0, 4 * M0, 8 * M0)
        if TABLE.rate(T4, g, b) > 0]


def _error(model: object, points: list[tuple[int, int]]) -> float:
    """Median relative error of ``model`` against the table at ``points``."""
    return float(np.median([abs(model.rate(T4, g, b) / TABLE.rate(T4, g, b) - 1)  # type: ignore[attr-defined]
                            for g, b in points]))


def test_a_job_that_names_its_model_starts_from_the_table() -> None:
    spec = JobSpec(name="c", run="true", batch_size=BatchRange(min=M0, max=4096),
                   gpus=GpuRange(min=1, max=16), work_samples=10**8, model="cifar10")
    job = JobRecord(id="c-1", spec=spec, team="t")
    for g, b in GRID:
        assert samples_per_sec(job, g, b, T4) == pytest.approx(TABLE.rate(T4, g, b))
    assert samples_per_sec(job, 4, M0, Accelerator.V100) != samples_per_sec(job, 4, M0, T4)


def test_the_generic_prior_converges_to_the_table_as_configurations_are_reported() -> None:
    """Held-out configurations (never reported) are predicted better and better: the step-time
    constants are refitted from what the job measured."""
    held_out = GRID[1::2]
    reported = GRID[0::2]
    prior = GenericPrior(init_batch=M0)
    errors = [_error(fit(prior, [(g, b, TABLE.rate(T4, g, b)) for g, b in reported[:n]], T4),
                     held_out) for n in (1, 3, len(reported))]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 0.25
    assert _error(fit(prior, [], T4), held_out) > 2 * errors[2]


def test_measured_configurations_are_exact_and_the_rest_scaled() -> None:
    """A job that runs 20% slower than its table everywhere it was measured is predicted 20%
    slower elsewhere, and exactly as measured where it was."""
    seen = [(g, b, 0.8 * TABLE.rate(T4, g, b)) for g, b in GRID[:3]]
    model = fit(TABLE, seen, T4)
    assert model.scale == pytest.approx(0.8)
    g, b, y = seen[0]
    assert model.rate(T4, g, b) == y
    g, b = GRID[-1]
    assert model.rate(T4, g, b) == pytest.approx(0.8 * TABLE.rate(T4, g, b))


def test_the_refit_recovers_other_constants() -> None:
    """Measurements from a step-time model with other constants pin the generic model to them."""
    truth = ThroughputModel(sample_time_s=0.004, step_overhead_s=0.03, sync_s=0.005)
    seen = [(g, b, truth.throughput(g, b)) for g in (1, 2, 4, 8) for b in (64, 256, 1024)]
    model = fit(GenericPrior(), seen, T4)
    for g, b in ((3, 128), (16, 2048)):
        assert model.rate(T4, g, b) == pytest.approx(truth.throughput(g, b), rel=0.05)


def test_job_model_uses_the_agent_reports() -> None:
    spec = JobSpec(name="x", run="true", batch_size=BatchRange(min=32, max=512),
                   work_samples=1000)
    job = JobRecord(id="x-1", spec=spec, team="t", measured={"T4:2x64": 1000.0})
    assert job_model(job).rate(T4, 2, 64) == 1000.0


def test_measurements_count_only_on_the_type_they_were_taken_on() -> None:
    """A job that ran on A100 and now runs on T4: the A100 figure says nothing of T4."""
    spec = JobSpec(name="x", run="true", accelerators=[T4, Accelerator.A100],
                   batch_size=BatchRange(min=32, max=512), work_samples=1000)
    ran_a100 = {"A100:2x64": 9000.0}
    on_t4 = JobRecord(id="x-1", spec=spec, team="t", pool="aws:east:spot:T4", measured=ran_a100)
    on_a100 = on_t4.model_copy(update={"pool": "aws:east:spot:A100"})
    assert job_model(on_a100).rate(Accelerator.A100, 2, 64) == 9000.0
    prior = JobRecord(id="x-2", spec=spec, team="t", pool="aws:east:spot:T4")
    assert job_model(on_t4).rate(T4, 2, 64) == job_model(prior).rate(T4, 2, 64)


def test_a_measured_noise_scale_sets_the_generic_priors_efficiency() -> None:
    """The runtime's gradient noise scale (in samples) replaces the generic prior's assumption
    of no statistical loss: with a noise scale of 64 samples, 512-sample batches are worth
    (64/32 + 1) / (64/32 + 512/32) = 1/6 per sample of what 32-sample batches are, so the
    best batch on one GPU is a small one; with none measured, the largest."""
    spec = JobSpec(name="x", run="true", batch_size=BatchRange(min=32, max=512),
                   work_samples=1000)
    plain = JobRecord(id="x-1", spec=spec, team="t")
    noisy = plain.model_copy(update={"grad_noise_scale": 64.0})
    assert job_model(noisy).prior.noise == pytest.approx(2.0)  # in initial batches (32)
    eff = job_model(noisy).rate(T4, 1, 512) / job_model(plain).rate(T4, 1, 512)
    assert eff == pytest.approx(3 / 18)
    best = {j.id: max((32, 64, 128, 256, 512), key=lambda b: job_model(j).rate(T4, 1, b))
            for j in (plain, noisy.model_copy(update={"id": "x-2"}))}
    assert best["x-1"] == 512 and best["x-2"] < 512


def test_the_generic_refit_keeps_a_measured_noise_scale() -> None:
    """Throughput measured at two batch sizes would refit the noise scale; a measured one
    stays."""
    seen = [(1, 32, 1000.0), (1, 256, 2000.0)]
    assert fit(GenericPrior(init_batch=32), seen, T4).prior.noise != 5.0
    assert fit(GenericPrior(init_batch=32, noise=5.0), seen, T4,
               noise_known=True).prior.noise == 5.0
