"""The client CLI against a real API server (uvicorn) and redis-server: commands, exit codes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from broker.models import JobState
from broker.store import Plan, Store
from policies.models import Accelerator, Market, Pool
from tests.api_server import TOKENS, ApiServer, api_stack
from tests.builders import fleet

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "jobs" / "digits-elastic.yaml"
SKY = ROOT / "examples" / "jobs" / "skypilot-task.yaml"


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Store]]:
    with api_stack(tmp_path_factory.mktemp("cli")) as stack:
        yield stack


@pytest.fixture
def store(shared: tuple[ApiServer, Store]) -> Store:
    shared[1].r.flushdb()
    return shared[1]


@pytest.fixture
def env(shared: tuple[ApiServer, Store], tmp_path: Path) -> dict[str, str]:
    """Client settings for team ``ml``; the config file lives in the test's temp dir."""
    return {"FLEET_URL": shared[0].url, "FLEET_TOKEN": TOKENS["ml"],
            "FLEET_CONFIG": str(tmp_path / "fleet" / "config.yaml")}


def test_launch_list_show_cancel(store: Store, env: dict[str, str]) -> None:
    code, out, _ = fleet(env, "launch", str(EXAMPLE), "--gpus", "2:3", "--json")
    assert code == 0
    job = json.loads(out)
    assert job["spec"]["gpus"] == {"min": 2, "max": 3, "default": None} and job["team"] == "ml"
    assert store.get_job(job["id"]) is not None
    code, out, _ = fleet(env, "launch", str(EXAMPLE), "--spot", "never")
    assert code == 0 and "submitted digits-elastic-" in out
    code, out, _ = fleet(env, "jobs", "--json")
    assert code == 0 and [j["spec"]["spot"] for j in json.loads(out)] == ["preferred", "never"]
    code, out, _ = fleet(env, "jobs")
    assert code == 0 and job["id"] in out and "queued" in out
    code, out, _ = fleet(env, "job", job["id"])
    assert code == 0 and "state queued" in out and "gpus 2-3" in out
    code, out, _ = fleet(env, "job", job["id"], "--json")
    assert json.loads(out)["job"]["id"] == job["id"]
    code, out, _ = fleet(env, "cancel", job["id"])
    assert code == 0 and "cancelled" in out
    assert store.get_job(job["id"]).state is JobState.CANCELLED  # type: ignore[union-attr]


def test_show_has_the_checkpoint_step_and_size(store: Store, env: dict[str, str]) -> None:
    code, out, _ = fleet(env, "launch", str(EXAMPLE), "--json")
    job = store.get_job(json.loads(out)["id"])
    assert code == 0 and job is not None
    plan = Plan()
    plan.change(job, JobState.LAUNCHING, gpus=1, attempt=1)
    store.apply(plan)
    store.record_heartbeat(job.id, 1, samples_done=64, checkpoint_step=12,
                           checkpoint_bytes=52_100_000_000)
    code, out, _ = fleet(env, "job", job.id)
    assert code == 0 and "checkpoint step 12 (52.1 GB)" in out and "nodes" not in out
    gang = store.get_job(job.id)
    assert gang is not None
    plan = Plan()
    plan.change(gang, gpus=16, nodes=2, round=1)
    store.apply(plan)
    code, out, _ = fleet(env, "job", job.id)
    assert code == 0 and "attempt 1, 2 nodes (rendezvous round 1)" in out


def test_skypilot_launch_prints_notes(store: Store, env: dict[str, str]) -> None:
    code, out, err = fleet(env, "launch", str(SKY))
    assert code == 0 and "submitted digits-sky-" in out and "note: use_spot" in err


def test_bad_spec_exits_2_and_stores_nothing(store: Store, env: dict[str, str],
                                             tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: ../x\nrun: x\ngpus: -1\nbatch_size: 8\nwork: {samples: 1}\n"
                   "accelerators: [TPU]\n")
    code, _, err = fleet(env, "launch", str(bad))
    assert code == 2
    for field in ("name (got '../x')", "gpus.min (got -1)", "accelerators[0] (got 'TPU')"):
        assert field in err
    assert fleet(env, "launch", str(tmp_path / "missing.yaml"))[0] == 2
    assert fleet(env, "launch", str(EXAMPLE), "--gpus", "x")[0] == 2
    assert store.list_jobs() == []


def test_exit_codes_not_found_auth_unreachable(store: Store, env: dict[str, str]) -> None:
    code, _, err = fleet(env, "job", "nope-1")
    assert code == 3 and "no job 'nope-1'" in err
    assert fleet(env, "cancel", "../../x")[0] in (2, 3)
    code, _, err = fleet({**env, "FLEET_TOKEN": "not-a-real-token-000"}, "jobs")
    assert code == 4 and "invalid token" in err
    code, _, err = fleet({**env, "FLEET_TOKEN": ""}, "jobs")
    assert code == 4 and "fleet login" in err
    assert fleet(env, "chaos", "preempt", "east")[0] == 4  # a team token is not admin
    code, _, err = fleet({**env, "FLEET_URL": "http://127.0.0.1:9"}, "jobs")
    assert code == 5 and "fleet up" in err


def test_a_server_that_is_not_the_broker(env: dict[str, str]) -> None:
    other_app = FastAPI()
    other_app.get("/v1/jobs", response_class=PlainTextResponse)(lambda: "hello")
    other = ApiServer(other_app).start()
    try:
        code, _, err = fleet({**env, "FLEET_URL": other.url}, "jobs")
    finally:
        other.stop()
    assert code == 5 and "not as a FleetBroker API" in err


def test_logs_and_follow(store: Store, env: dict[str, str]) -> None:
    code, out, _ = fleet(env, "launch", str(EXAMPLE), "--json")
    job_id = json.loads(out)["id"]
    store.append_log(job_id, ["line 0", "line 1"])
    code, out, _ = fleet(env, "logs", job_id)
    assert code == 0 and out.splitlines() == ["line 0", "line 1"]
    assert fleet(env, "logs", job_id, "--offset", "1")[1].splitlines() == ["line 1"]

    def later() -> None:
        time.sleep(0.4)
        store.append_log(job_id, ["line 2"])
        time.sleep(0.3)
        store.request_cancel(job_id)

    writer = threading.Thread(target=later)
    writer.start()
    code, out, _ = fleet(env, "logs", job_id, "--follow", "--interval", "0.1")
    writer.join()
    assert code == 0 and out.splitlines() == ["line 0", "line 1", "line 2"]


def test_events(store: Store, env: dict[str, str]) -> None:
    job_id = json.loads(fleet(env, "launch", str(EXAMPLE), "--json")[1])["id"]
    fleet(env, "cancel", job_id)
    code, out, _ = fleet(env, "events", "--job", job_id)
    assert code == 0 and [line.split()[1] for line in out.splitlines()] == [
        "submitted", "cancelled"]
    code, out, _ = fleet(env, "events", "--json")  # pages through all
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["submitted", "cancelled"]


def test_capacity_and_chaos(store: Store, env: dict[str, str]) -> None:
    store.set_pools([Pool(cloud="local", region="east", accelerator=Accelerator.T4,
                          market=Market.SPOT, nodes=2, gpus_per_node=2,
                          price_per_gpu_hour=0.25)])
    code, out, _ = fleet(env, "capacity", "--json")
    assert code == 0 and json.loads(out)["pools"][0]["capacity"] == 4
    code, out, _ = fleet(env, "capacity")
    assert "east" in out and "spot" in out and "0/4 GPUs in use" in out
    admin = {**env, "FLEET_TOKEN": TOKENS["admin"]}
    code, out, _ = fleet(admin, "chaos", "preempt", "east", "--duration", "5")
    assert code == 0 and "preempting east" in out
    assert store.pop_commands() == [{"kind": "preempt", "region": "east", "duration_s": 5.0}]
    code, _, err = fleet(admin, "chaos", "preempt", "mars")
    assert code == 3 and "spot regions: local:east" in err
    code, _, err = fleet(admin, "chaos", "node", "nope-1", "--rank", "1", "--kill")
    assert code == 3 and "no job 'nope-1'" in err


def test_login_saves_config_then_commands_use_it(store: Store, env: dict[str, str]) -> None:
    code, out, _ = fleet(env, "login", "--url", env["FLEET_URL"], "--token", TOKENS["vision"])
    path = Path(env["FLEET_CONFIG"])
    assert code == 0 and path.exists() and stat.S_IMODE(path.stat().st_mode) == 0o600
    bare = {"FLEET_CONFIG": env["FLEET_CONFIG"], "FLEET_URL": "", "FLEET_TOKEN": ""}
    code, out, _ = fleet(bare, "launch", str(SKY), "--json")
    assert code == 0 and json.loads(out)["team"] == "vision"
    code, _, err = fleet(bare, "launch", str(EXAMPLE))  # its spec says team: ml
    assert code == 4 and "belongs to team 'vision'" in err
    assert fleet(env, "login", "--url", env["FLEET_URL"], "--token", "wrong-token-0000000")[0] == 4


def test_token_command(env: dict[str, str]) -> None:
    code, out, _ = fleet(env, "token")
    lines = dict(line.split(":", 1) for line in out.splitlines())
    assert code == 0 and len(lines["token_sha256"].strip()) == 64


def test_python_m_broker_subprocess(store: Store, env: dict[str, str]) -> None:
    run = subprocess.run([sys.executable, "-m", "broker", "launch", str(SKY), "--json"],
                         env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["spec"]["accelerators"] == ["T4", "V100"]
    bad = subprocess.run([sys.executable, "-m", "broker", "job", "nope-1"],
                         env={**os.environ, **env}, cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 3 and "Traceback" not in bad.stderr


def test_a_cpu_job_is_listed_and_shown_in_cpu_nodes(store: Store, env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """A CPU-only SkyPilot task holds CPU nodes, not GPUs: ``fleet jobs`` and ``fleet job``
    say so instead of a GPU count and batch."""
    task = tmp_path / "cpu.yaml"
    task.write_text("name: cpu\nnum_nodes: 2\nresources: {cpus: 2+}\nrun: echo hi\n")
    code, out, _ = fleet(env, "launch", str(task), "--json")
    assert code == 0, out
    job = json.loads(out)
    record = store.get_job(job["id"])
    assert record is not None
    plan = Plan()
    plan.change(record, gpus=2, pool="local:lab:on-demand:CPU")
    store.apply(plan)
    code, out, _ = fleet(env, "jobs")
    assert code == 0 and "2 CPU" in out, out
    code, out, _ = fleet(env, "job", job["id"])
    assert code == 0, out
    assert "CPU nodes 2  cpus 2+" in out and "assigned 2 CPU nodes, pool local:lab" in out
    assert "GPUs" not in out and "batch" not in out
