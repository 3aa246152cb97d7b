"""The gradient noise scale the runtime measures (``broker.runtime.noise``) and reports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from broker.runtime.noise import NoiseScale, squared_norm
from tests.runtime.jobs import agent_command, job_env, run_job


def test_the_estimate_converges_to_the_true_noise_scale() -> None:
    """Gradients with a known noise scale: true gradient |G|^2 = 1, per-sample noise of
    trace 64, so B_noise = 64 samples. Four replicas of 16 samples each, one rank's view."""
    gen = torch.Generator().manual_seed(0)
    d, per_rank, ranks, trace = 64, 16, 4, 64.0
    true = torch.randn(d, generator=gen)
    true /= true.norm()
    noise = NoiseScale()
    for _ in range(3000):
        # each replica's mean gradient over its samples: covariance trace / per_rank
        means = true + torch.randn(ranks, d, generator=gen) * math.sqrt(trace / d / per_rank)
        noise.update(means[0].pow(2).sum(), per_rank, means.mean(0).pow(2).sum(),
                     per_rank * ranks)
    assert noise.value is not None and abs(noise.value / trace - 1) < 0.15


def test_one_batch_size_gives_no_estimate() -> None:
    noise = NoiseScale()
    noise.update(torch.tensor(2.0), 32, torch.tensor(2.0), 32)
    assert noise.value is None


def test_consecutive_steps_of_one_replica_converge_to_the_true_noise_scale() -> None:
    """One replica, 32 samples a step: pairs of steps' mean gradients stand in for two
    replicas (the true gradient held still here, so the estimate is unbiased)."""
    gen = torch.Generator().manual_seed(1)
    d, batch, trace = 1024, 32, 64.0
    true = torch.randn(d, generator=gen)
    true /= true.norm()
    noise = NoiseScale()
    for _ in range(3000):
        a, b = true + torch.randn(2, d, generator=gen) * math.sqrt(trace / d / batch)
        noise.update_pair(a, b, batch)
    assert noise.value is not None and abs(noise.value / trace - 1) < 0.15


def test_the_squared_norm_matches_the_sum_of_squares_in_every_precision() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 10_000, generator=g)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        got = squared_norm(x.to(dtype))
        assert got.dtype in (torch.float32, torch.float64)
        assert math.isclose(float(got), float(x.to(dtype).double().pow(2).sum()), rel_tol=1e-4)


def test_a_two_rank_job_reports_its_noise_scale_and_accelerator(
    httpserver: HTTPServer, tmp_path: Path,
) -> None:
    """A real two-rank job (gloo, CPU) under the agent: its heartbeats carry the noise scale
    the trainer measured and the node's accelerator, so the broker keys throughput by type."""
    beats: list[dict] = []

    def heartbeat(request: Request) -> Response:
        beats.append(request.get_json())
        return Response(json.dumps({}), content_type="application/json")

    httpserver.expect_request("/v1/agent/heartbeat", method="POST").respond_with_handler(heartbeat)
    env = job_env(tmp_path, nproc=2, heartbeat_interval=0.2, job_id="job-1", attempt=1,
                  broker_url=httpserver.url_for("/"), agent_token="t", accelerator="T4")
    run = run_job(agent_command("--steps", "120", "--batch-size", "32"), env, tmp_path)
    assert run.code == 0, run.output
    measured = [b for b in beats if b.get("grad_noise_scale") is not None]
    assert measured, beats[-3:]
    last = measured[-1]
    assert math.isfinite(last["grad_noise_scale"]) and last["grad_noise_scale"] > 0
    assert last["accelerator"] == "T4" and last["world_size"] == 2


def test_a_one_rank_job_reports_its_noise_scale(httpserver: HTTPServer, tmp_path: Path) -> None:
    """A single replica has no second gradient in a step; consecutive steps give one."""
    beats: list[dict] = []

    def heartbeat(request: Request) -> Response:
        beats.append(request.get_json())
        return Response(json.dumps({}), content_type="application/json")

    httpserver.expect_request("/v1/agent/heartbeat", method="POST").respond_with_handler(heartbeat)
    env = job_env(tmp_path, nproc=1, heartbeat_interval=0.2, job_id="job-1", attempt=1,
                  broker_url=httpserver.url_for("/"), agent_token="t", accelerator="T4")
    run = run_job(agent_command("--steps", "120", "--batch-size", "32"), env, tmp_path)
    assert run.code == 0, run.output
    measured = [b["grad_noise_scale"] for b in beats if b.get("grad_noise_scale") is not None]
    assert measured and all(math.isfinite(v) and v > 0 for v in measured), beats[-3:]
    assert beats[-1]["world_size"] == 1
