"""End to end on moto's EC2: the broker (API, leader loop, real redis-server) launches a real
PyTorch job on a spot instance in us-east-1, a local metadata server gives the instance the
two-minute spot notice, the agent checkpoints (to S3 on the same moto server), the broker blocks
us-east-1, terminates the instance and launches in us-west-2, where the job resumes from its
checkpoint and completes. The job has a secret: each instance's agent fetches it from the broker
with its attempt token, and no user data moto keeps holds it.

moto's instances run nothing, so the test plays each instance: it reads the user data the broker
gave the instance from moto's EC2 and runs it with bash, with the instance metadata address
(169.254.169.254) pointed at the local metadata server and the AWS endpoint at moto (an
instance's IAM role and region endpoints in a real account).
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer
from pytest_httpserver import HTTPServer, URIPattern
from werkzeug import Request, Response

from broker.models import JobState
from broker.protocol import Env
from broker.scheduler import SchedulerConfig
from broker.sealed import Sealer
from broker.server import BrokerConfig, Stack
from broker.store import BLOCKLIST_KEY
from policies.migration import Blocklist
from policies.models import Accelerator, BatchMode, BatchRange, GpuRange, JobSpec, SpotPolicy
from providers import bootstrap
from tests.cloud_env import fake_aws_keys
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "ami-12c6146b"  # in moto's default image list
METADATA_IP = "http://169.254.169.254"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
STEPS = 150
SECRET = "e2e-secret-value-7d41c0b9e2"
# The job's setup shows what it saw of its secret as a digest: the value is nowhere in the spec.
SHOW_SECRET = ("python -c \"import hashlib, os; print('secret digest', hashlib.sha256("
               "os.environ.get('E2E_SECRET', '').encode()).hexdigest())\"")
FLEET = """
name: e2e
grace_period_s: 10
clouds:
  aws:
    regions: [us-east-1, us-west-2]
    accelerators: [V100]
    markets: [spot]
    max_gpus: 1
    options: {{image_id: {image}, endpoint_url: "{endpoint}", broker_id: e2e-broker}}
# A third spot location (a pretend local one, dearer than both): SpotHedge resets every mark
# when fewer than two locations stay active, so with two locations nothing would stay blocked.
regions:
  - {{cloud: local, region: lab, market: spot, accelerator: V100, price_per_gpu_hour: 3.0,
     gpus: 1}}
"""


class Metadata:
    """The instance metadata service of every played instance: ``/<vm>/latest/...``; 404 on
    ``spot/instance-action`` until ``notify(vm)``, then EC2's instance-action JSON."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.noticed: set[str] = set()
        server.expect_request(_AnyPath()).respond_with_handler(self._handle)

    def base(self, vm: str) -> str:
        return self.server.url_for(f"/{vm}").rstrip("/")

    def notify(self, vm: str) -> None:
        self.noticed.add(vm)

    def _handle(self, request: Request) -> Response:
        vm, _, rest = request.path.lstrip("/").partition("/")
        if f"/{rest}" == NOTICE_PATH and vm in self.noticed:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 120))
            return Response(f'{{"action": "terminate", "time": "{when}"}}',
                            content_type="application/json")
        return Response("Not Found", status=404)


class _AnyPath(URIPattern):
    """Every path (the metadata server answers them all itself)."""

    def match(self, uri: str) -> bool:
        return True


@pytest.fixture
def aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_aws_keys(monkeypatch, tmp_path)
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path / "config"))  # the shipped catalog


@pytest.fixture
def moto_url(aws_env: None) -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


class Instance:
    """One played EC2 instance: its user data run by bash, output in ``log``."""

    def __init__(self, inst: dict, user_data: str, metadata: Metadata, moto_url: str,
                 tmp: Path) -> None:
        self.id = inst["InstanceId"]
        self.region = inst["Placement"]["AvailabilityZone"][:-1]
        self.dir = tmp / self.id
        (self.dir / "tmp").mkdir(parents=True)
        bin_dir = Path(sys.executable).parent  # the image's python3 is this environment's
        script = self.dir / "user-data.sh"
        script.write_text(user_data.replace(METADATA_IP, metadata.base(self.id)))
        env = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.dir), "TMPDIR": str(self.dir / "tmp"),  # its own disk and cache
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": self.region, "AWS_ENDPOINT_URL": moto_url,
        }
        self.log = self.dir / "console.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


def wait_for(cond: Callable[[], object], what: str, timeout: float = 40) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def job_instances(ec2: dict[str, object], job_id: str, states: list[str]) -> list[dict]:
    found = []
    for client in ec2.values():
        resp = client.describe_instances(Filters=[  # type: ignore[attr-defined]
            {"Name": f"tag:{bootstrap.JOB_TAG}", "Values": [job_id]},
            {"Name": "instance-state-name", "Values": states}])
        found += [i for r in resp["Reservations"] for i in r["Instances"]]
    return found


def user_data(ec2: dict[str, object], inst: dict) -> str:
    region = inst["Placement"]["AvailabilityZone"][:-1]
    raw = ec2[region].describe_instance_attribute(  # type: ignore[attr-defined]
        InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]["Value"]
    return base64.b64decode(raw).decode()


def test_spot_notice_on_moto_migrates_the_job_to_another_region(
        moto_url: str, redis_server: RedisServer, httpserver: HTTPServer, tmp_path: Path) -> None:
    started = time.monotonic()
    session = boto3.Session()
    ec2 = {r: session.client("ec2", region_name=r, endpoint_url=moto_url)
           for r in ("us-east-1", "us-west-2")}
    session.client("s3", endpoint_url=moto_url).create_bucket(Bucket="fleet-ckpt")
    metadata = Metadata(httpserver)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET.format(image=IMAGE, endpoint=moto_url))
    config = BrokerConfig(state_dir=tmp_path / "state", redis_url=redis_server.url, fleet=fleet,
                          tick_s=0.2, lease_ttl_s=10, heartbeat_interval_s=0.5,
                          scheduler=SchedulerConfig(min_rescale_interval_s=600))
    stack = Stack(config, port=0).start()
    instances: list[Instance] = []
    try:
        store = stack.broker.store  # type: ignore[union-attr]
        spec = JobSpec(
            name="e2e", team="ml", accelerators=[Accelerator.V100], spot=SpotPolicy.PREFERRED,
            run=f"python examples/train_synthetic.py --size tiny --context 32 --steps {STEPS} "
                "--checkpoint-every-steps 10",
            gpus=GpuRange(min=1, max=1), batch_size=BatchRange(min=16, max=16),
            batch_mode=BatchMode.FIXED, work_samples=STEPS * 16,
            checkpoint={"uri": "s3://fleet-ckpt/jobs/e2e"}, setup=SHOW_SECRET,
            secret_envs=["E2E_SECRET"],
            envs={"FLEET_NOTICE_INTERVAL": "0.2", "FLEET_PROGRESS_INTERVAL": "0"})
        sealed = Sealer.load(config.state_dir).seal({"E2E_SECRET": SECRET})
        job = store.submit(spec, team="ml", sealed_secrets=sealed)

        # 1. The broker launches a spot instance in the cheaper region, us-east-1.
        (first,) = wait_for(lambda: job_instances(ec2, job.id, ["pending", "running"]),
                            "the first launch")  # type: ignore[misc]
        assert first["Placement"]["AvailabilityZone"].startswith("us-east-1")
        assert first["InstanceLifecycle"] == "spot" and first["InstanceType"] == "p3.2xlarge"
        script = user_data(ec2, first)
        assert f"{METADATA_IP}{NOTICE_PATH}" in script  # the agent polls the real address
        assert SECRET not in script and f"export {Env.SECRET_ENVS}=E2E_SECRET" in script
        instances.append(Instance(first, script, metadata, moto_url, tmp_path))
        phases = {"first launch": time.monotonic() - started}

        # 2. It trains and checkpoints; then EC2 gives the two-minute notice.
        wait_for(lambda: (store.get_job(job.id).checkpoint_step or 0) >= 30,  # type: ignore
                 "the first checkpoints", timeout=60)
        metadata.notify(first["InstanceId"])
        phases["notice"] = time.monotonic() - started

        # 3. The agent checkpoints and exits 75; the broker blocks us-east-1, terminates the
        # instance and launches in us-west-2.
        assert instances[0].proc.wait(timeout=30) == 75
        noticed_at = store.get_job(job.id).checkpoint_step  # type: ignore[union-attr]
        (second,) = wait_for(lambda: [i for i in job_instances(ec2, job.id, ["pending", "running"])
                                      if i["InstanceId"] != first["InstanceId"]],
                             "the second launch")  # type: ignore[misc]
        assert not job_instances(ec2, job.id, ["pending", "running"])[1:]  # never two at once
        phases["second launch"] = time.monotonic() - started
        assert second["Placement"]["AvailabilityZone"].startswith("us-west-2")
        script = user_data(ec2, second)
        assert SECRET not in script and f"export {Env.SECRET_ENVS}=E2E_SECRET" in script
        instances.append(Instance(second, script, metadata, moto_url, tmp_path))

        # 4. The job resumes from its checkpoint there and completes.
        assert instances[1].proc.wait(timeout=60) == 0, instances[1].output()[-3000:]
        wait_for(lambda: store.get_job(job.id).state is JobState.COMPLETED,  # type: ignore
                 "completion")
        elapsed = time.monotonic() - started

        done = store.get_job(job.id)
        assert done is not None and done.preemptions == 1 and done.migrations == 1
        log2 = instances[1].output()
        resumed = int(log2.split("resumed from step ")[1].split()[0])
        assert noticed_at is not None and resumed >= noticed_at >= 30  # nothing lost before it
        assert f"trained to step {STEPS}" in log2
        # The size the agent reported is that of the last checkpoint's objects in S3.
        listed = session.client("s3", endpoint_url=moto_url).list_objects_v2(
            Bucket="fleet-ckpt", Prefix=f"jobs/e2e/step-{STEPS:010d}/")["Contents"]
        assert done.checkpoint_step == STEPS
        assert done.checkpoint_bytes == sum(o["Size"] for o in listed)
        assert "preemption notice: aws spot instance-action terminate" in instances[0].output()
        # Each attempt's job saw its secret, which its agent fetched; no console shows it.
        seen = f"secret digest {hashlib.sha256(SECRET.encode()).hexdigest()}"
        for inst in instances:
            assert seen in inst.output() and SECRET not in inst.output()

        # moto: both instances are gone (the second once the agent reported it finished).
        wait_for(lambda: not job_instances(ec2, job.id, ["pending", "running"]), "terminations")
        states = {i["InstanceId"]: i["State"]["Name"] for i in job_instances(
            ec2, job.id, ["shutting-down", "terminated"])}
        assert states == {first["InstanceId"]: "terminated", second["InstanceId"]: "terminated"}

        one, two = store.placements(job.id)
        assert (one.cloud, one.region, two.region) == ("aws", "us-east-1", "us-west-2")
        assert one.end is not None and one.end <= two.start  # intervals never overlap
        assert one.price_per_gpu_hour < two.price_per_gpu_hour  # it left the cheaper region

        blocklist = Blocklist.model_validate_json(store.r.get(f"{store.p}{BLOCKLIST_KEY}"))
        assert blocklist.is_blocked("aws:us-east-1", time.time())
        assert set(blocklist.active(time.time())) == {"aws:us-west-2", "local:lab"}
        events = store.events(job_id=job.id, limit=1000)
        kinds = [e.type for e in events]
        after = kinds[kinds.index("preempted"):]
        assert after[:2] == ["preempted", "location-blocked"]
        assert [k for k in after if k in ("suspended", "launching", "running", "completed")] == [
            "suspended", "launching", "running", "completed"]
        preempted = next(e for e in events if e.type == "preempted")
        assert "instance-action terminate" in preempted.data["notice"]
        print(f"\ne2e: notice at checkpoint step {noticed_at}, resumed from step {resumed}, "
              f"completed in {elapsed:.1f} s; " + ", ".join(
                  f"{k} at {v:.1f} s" for k, v in phases.items()))
    finally:
        for inst in instances:  # shown when the test fails
            print(f"--- instance {inst.id} ({inst.region}) console:\n{inst.output()[-4000:]}")
            inst.stop()
        stack.stop()

