"""A job's secrets reach a cloud node's agent from the broker, never through its start script:
``POST /v1/agent/secrets`` on a real API over a real redis-server answers the job's current
attempt's token alone; the launch request and start script of a backend that starts the agent
(a cloud VM) name the secrets and hold no value; the real agent fetches them before any of the
job's code runs, or fails the launch naming why."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker import secrets
from broker.actuator import ActuatorConfig, launch_request
from broker.auth import attempt_token
from broker.models import Intent, IntentKind, JobRecord, JobState
from broker.protocol import SECRETS_PATH, Env
from broker.sealed import Sealer
from broker.spec import LAUNCH_MEDIA
from broker.store import Store
from policies.models import Accelerator, Market, Pool
from providers import bootstrap
from providers.aws.provider import AwsProvider
from providers.base import Provider, ProviderError
from providers.local.provider import LocalProvider
from providers.skypilot import SkyPilotProvider
from tests.api_server import TOKENS, ApiServer, api_stack
from tests.test_rendezvous import change

ROOT = Path(__file__).resolve().parent.parent
HF = "hf_fetched-secret-value-5b0c7e1a93"
WANDB = "wandb-fetched-secret-2f9d4c8e71"
SPEC = """
name: secretive
run: python train.py
gpus: 1
batch_size: 32
work: {steps: 10}
container_image: ghcr.io/example/train:1
run_per_node: true
envs: {PLAIN: visible}
"""
POOL = Pool(cloud="aws", region="us-east-1", accelerator=Accelerator.V100,
            market=Market.ON_DEMAND, nodes=1, gpus_per_node=1, price_per_gpu_hour=3.0)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[ApiServer, Store]]:
    with api_stack(tmp_path, sealer=Sealer.load(tmp_path / "state")) as got:
        yield got


def launch(server: ApiServer, job_secrets: dict[str, str]) -> str:
    """A job submitted as ``fleet launch --secret`` does; its id."""
    body = {"spec": SPEC, "secrets": job_secrets}
    r = httpx.post(f"{server.url}/v1/jobs", content=json.dumps(body), timeout=10,
                   headers={"Authorization": f"Bearer {TOKENS['ml']}",
                            "Content-Type": LAUNCH_MEDIA})
    assert r.status_code == 201, r.text
    return r.json()["job"]["id"]


def ask(server: ApiServer, job_id: str, attempt: int, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{server.url}{SECRETS_PATH}", headers=headers, timeout=10,
                      json={"job_id": job_id, "attempt": attempt})


def token(job_id: str, attempt: int) -> str:
    return attempt_token(TOKENS["agent"], job_id, attempt)


def test_the_current_attempts_token_alone_gets_the_secrets(stack: tuple[ApiServer, Store]
                                                           ) -> None:
    server, store = stack
    job_id = launch(server, {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB})
    other = launch(server, {})
    # Not launched yet: no attempt of it launches or runs.
    r = ask(server, job_id, 0, token(job_id, 0))
    assert r.status_code == 409 and "queued" in r.json()["error"]["message"]
    change(store, job_id, JobState.LAUNCHING, attempt=1, gpus=1)
    want = {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB}
    r = ask(server, job_id, 1, token(job_id, 1))
    assert r.status_code == 200 and r.json() == {"secrets": want}
    change(store, job_id, JobState.RUNNING)
    assert ask(server, job_id, 1, token(job_id, 1)).json() == {"secrets": want}
    assert {HF, WANDB} <= secrets.registered()  # scrubbed from any log line or reason
    # The fleet's agent key (it derives every attempt token) may; no admin or team token.
    assert ask(server, job_id, 1, TOKENS["agent"]).json() == {"secrets": want}
    for who in ("admin", "ml"):
        r = ask(server, job_id, 1, TOKENS[who])
        assert r.status_code == 403, (who, r.text)
    r = ask(server, job_id, 1, None)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert ask(server, job_id, 1, "not-a-token-0123456789").status_code == 401
    # Another job's token, for this job or its own (which has none).
    change(store, other, JobState.LAUNCHING, attempt=1, gpus=1)
    r = ask(server, job_id, 1, token(other, 1))
    assert r.status_code == 403 and "another job or attempt" in r.json()["error"]["message"]
    assert ask(server, other, 1, token(other, 1)).json() == {"secrets": {}}
    # The next attempt: the last one's token gets nothing, for either attempt.
    change(store, job_id, JobState.SUSPENDING)
    r = ask(server, job_id, 1, token(job_id, 1))
    assert r.status_code == 409 and "suspending" in r.json()["error"]["message"]
    change(store, job_id, JobState.SUSPENDED)
    change(store, job_id, JobState.LAUNCHING, attempt=2)
    r = ask(server, job_id, 1, token(job_id, 1))
    assert r.status_code == 409 and "not job" in r.json()["error"]["message"]
    assert ask(server, job_id, 2, token(job_id, 1)).status_code == 403
    assert ask(server, job_id, 2, token(job_id, 2)).json() == {"secrets": want}
    assert ask(server, "no-such-job", 1, token("no-such-job", 1)).status_code == 404
    bad = httpx.post(f"{server.url}{SECRETS_PATH}", json={"job_id": job_id}, timeout=10,
                     headers={"Authorization": f"Bearer {token(job_id, 2)}"})
    assert bad.status_code == 422
    # No refusal names a value.
    for r in (ask(server, job_id, 1, token(job_id, 1)), ask(server, job_id, 2, TOKENS["admin"])):
        assert HF not in r.text and WANDB not in r.text


def job_with_secrets(store: Store, server: ApiServer) -> JobRecord:
    job_id = launch(server, {"HF_TOKEN": HF, "WANDB_API_KEY": WANDB})
    return change(store, job_id, JobState.LAUNCHING, attempt=1, gpus=1)


def intent_of(job: JobRecord) -> Intent:
    return Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=1, attempt=1, gpus=1,
                  pool=POOL.id, batch_size=32)


@pytest.mark.parametrize(("backend", "fetches"), [
    (AwsProvider, True), (SkyPilotProvider, False), (LocalProvider, False)])
def test_which_backends_fetch(backend: type[Provider], fetches: bool) -> None:
    """Only a backend whose start script runs the agent and keeps the script in clear (a
    cloud's user data) leaves the values out; SkyPilot keeps them in its task's ``secrets``,
    the local provider hands them to a child process."""
    assert (backend.starts_agent and not backend.keeps_secrets) is fetches


def test_a_cloud_launch_names_the_secrets_and_holds_no_value(
        stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    server, store = stack
    job = job_with_secrets(store, server)
    opened = Sealer.load(tmp_path / "state").open(job.sealed_secrets or "")
    config = ActuatorConfig(broker_url="http://broker:8080", agent_token=TOKENS["agent"])
    request = launch_request(job, intent_of(job), POOL, config, backend_starts_agent=True,
                             secret_env=opened, fetch_secrets=True)
    for value in (HF, WANDB):
        assert not [k for k, v in request.env.items() if value in v]
    assert request.env[Env.SECRET_ENVS] == "HF_TOKEN,WANDB_API_KEY"
    assert {"HF_TOKEN", "WANDB_API_KEY"} & set(request.env) == set()
    assert request.secret_names == frozenset()
    # the container gets them by name (the agent has the values by then)
    assert request.env[Env.CONTAINER_ENV] == "HF_TOKEN,PLAIN,WANDB_API_KEY"
    assert request.env["PLAIN"] == "visible"
    script = bootstrap.agent_script(request, "aws", "fleetbroker==0.1.0")
    assert HF not in script and WANDB not in script
    assert f"export {Env.SECRET_ENVS}=HF_TOKEN,WANDB_API_KEY" in script
    # Where the values may travel (SkyPilot's task secrets, a local child), they still do.
    kept = launch_request(job, intent_of(job), POOL, config, backend_starts_agent=True,
                          secret_env=opened)
    assert (kept.env["HF_TOKEN"], kept.secret_names) == (HF, {"HF_TOKEN", "WANDB_API_KEY"})
    assert Env.SECRET_ENVS not in kept.env
    # No URL to fetch them from: the launch fails, naming why, before any node exists.
    with pytest.raises(ProviderError, match="fetches from the broker"):
        launch_request(job, intent_of(job), POOL, ActuatorConfig(agent_token=TOKENS["agent"]),
                       backend_starts_agent=True, secret_env=opened, fetch_secrets=True)


# The job's code: what it saw of each secret, as a digest (its command line is no place for
# the value either).
SHOW = ("import hashlib, os; print('secret digests', *(hashlib.sha256(os.environ.get(n, '')"
        ".encode()).hexdigest()[:16] for n in ('HF_TOKEN', 'WANDB_API_KEY')))")


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def run_agent(tmp: Path, server: ApiServer, job: JobRecord, agent_token: str
              ) -> subprocess.CompletedProcess[str]:
    """The real agent, as a cloud node's start script runs it: the names only, the token in a
    0600 file."""
    token_file = tmp / "agent-token"
    token_file.write_text(agent_token)
    token_file.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEET_", "HF_", "WANDB_"))}
    env.update({"PYTHONPATH": str(ROOT), Env.JOB_ID: job.id, Env.ATTEMPT: "1",
                Env.BROKER_URL: server.url, Env.AGENT_TOKEN_FILE: str(token_file),
                Env.SECRET_ENVS: "HF_TOKEN,WANDB_API_KEY", Env.HEARTBEAT_INTERVAL: "0.2",
                Env.REPORT_TIMEOUT: "10", Env.PROGRESS_FILE: str(tmp / "progress.json")})
    return subprocess.run(
        [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, "-c", SHOW],
        env=env, cwd=tmp, capture_output=True, text=True, timeout=60)


def test_the_agent_fetches_the_secrets_before_the_job_runs(
        stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    server, store = stack
    job = job_with_secrets(store, server)
    done = run_agent(tmp_path, server, job, token(job.id, 1))
    assert done.returncode == 0, done.stderr
    assert f"secret digests {digest(HF)} {digest(WANDB)}" in done.stdout
    assert "fetched the job's secrets from the broker: HF_TOKEN, WANDB_API_KEY" in done.stderr
    for value in (HF, WANDB):
        assert value not in done.stdout + done.stderr
    assert not (tmp_path / "agent-token").exists()


def test_an_agent_the_broker_refuses_fails_the_launch_naming_why(
        stack: tuple[ApiServer, Store], tmp_path: Path) -> None:
    server, store = stack
    job = job_with_secrets(store, server)
    done = run_agent(tmp_path, server, job, token(job.id, 2))  # another attempt's token
    assert done.returncode == 1, done.stderr
    assert "secret digests" not in done.stdout  # the job's code never ran
    assert "could not fetch the job's secrets from the broker: the broker refused (403): " \
           "agent endpoints need the job attempt's agent token" in done.stderr
    for value in (HF, WANDB):
        assert value not in done.stdout + done.stderr
