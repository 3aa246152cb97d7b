"""The agent stops a job cleanly (checkpoint, exit 75) on a notice or on the broker's request."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from pytest_httpserver import HTTPServer
from werkzeug import Request, Response

from tests.runtime.jobs import agent_command, job_env, progress, run_job

GRACE = 20.0
LONG = ["--steps", "5000", "--batch-size", "32"]  # minutes of work: only a stop ends it


def latest_manifest(ckpt: Path) -> dict:
    manifests = sorted(ckpt.glob("step-*/MANIFEST.json"))
    assert manifests, f"no complete checkpoint in {ckpt}"
    return json.loads(manifests[-1].read_text())


def test_aws_spot_notice_checkpoints_and_exits_75_within_grace(
    httpserver: HTTPServer, tmp_path: Path,
) -> None:
    noticed = threading.Event()

    def instance_action(_: Request) -> Response:
        if not noticed.is_set():
            return Response("Not Found", status=404)
        body = {"action": "terminate", "time": "2026-12-02T14:00:00Z"}
        return Response(json.dumps(body), content_type="application/json")

    path = "/latest/meta-data/spot/instance-action"
    httpserver.expect_request(path).respond_with_handler(instance_action)
    ckpt = tmp_path / "ckpt"
    env = job_env(tmp_path, nproc=2, grace_period=GRACE, notice_interval=0.2,
                  notice_aws_url=httpserver.url_for(path))
    run = run_job(agent_command(*LONG, "--checkpoint-dir", str(ckpt)), env, tmp_path,
                  stop_at_step=5, trigger=noticed.set)
    assert run.code == 75, run.output
    assert "preemption notice: aws spot instance-action terminate" in run.output
    assert run.ended_at - run.stopped_at < GRACE  # type: ignore[operator]
    saved = latest_manifest(ckpt)
    assert saved["step"] >= 5 and saved["world_size"] == 2
    assert progress(tmp_path)["checkpoint_step"] == saved["step"]


def test_broker_checkpoint_exit_action_stops_the_job(
    httpserver: HTTPServer, tmp_path: Path,
) -> None:
    beats: list[dict] = []

    def heartbeat(request: Request) -> Response:
        assert request.headers.get("Authorization") == "Bearer s3cret"
        beat = request.get_json()
        beats.append(beat)
        action = {"action": "checkpoint-exit"} if beat.get("step", 0) >= 5 else {}
        return Response(json.dumps(action), content_type="application/json")

    httpserver.expect_request("/v1/agent/heartbeat", method="POST").respond_with_handler(heartbeat)
    ckpt = tmp_path / "ckpt"
    env = job_env(tmp_path, nproc=1, grace_period=GRACE, heartbeat_interval=0.2, job_id="job-7",
                  attempt=3, broker_url=httpserver.url_for("/"), agent_token="s3cret")
    start = time.monotonic()
    run = run_job(agent_command(*LONG, "--checkpoint-dir", str(ckpt)), env, tmp_path)
    assert run.code == 75, run.output
    assert "broker asked for checkpoint-exit" in run.output
    asked = next(i for i, b in enumerate(beats) if b.get("step", 0) >= 5)
    assert beats[-1]["state"] == "stopped" and beats[asked + 1]["state"] in ("stopping", "stopped")
    keys = {"job_id", "attempt", "node_rank", "round", "state"}
    assert all(keys <= b.keys() for b in beats)
    progress_keys = {"step", "samples_done", "samples_per_sec", "world_size", "global_batch_size",
                     "checkpoint_step", "checkpoint_bytes"}  # once rank 0 wrote its progress
    first = next(i for i, b in enumerate(beats) if "step" in b)
    assert all(progress_keys <= b.keys() for b in beats[first:])
    assert beats[asked]["job_id"] == "job-7" and beats[asked]["attempt"] == 3
    assert beats[asked]["samples_done"] == 32 * beats[asked]["step"]
    assert beats[asked]["samples_per_sec"] > 0 and beats[asked]["global_batch_size"] == 32
    saved = latest_manifest(ckpt)
    assert saved["step"] >= beats[asked]["step"] and beats[-1]["checkpoint_step"] == saved["step"]
    assert time.monotonic() - start < 120
