"""The fleet's one provider: fleet files that declare clouds, routing by the pool's cloud (local
pretend regions and AWS on moto), skipping an unconfigured cloud with one clear log line and no
credentials in any log, the Redis-kept blocklist steering the scheduler and the reconciler, and
the preemptions counted per pool in Redis and the Spot Advisor priors steering placement."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from broker.actuator import Actuator, ActuatorConfig
from broker.models import JobState
from broker.reconciler import Reconciler
from broker.scheduler import Scheduler, SchedulerConfig, blocked_pools, refused_pools
from broker.server import Broker, BrokerConfig
from broker.store import Conflict, Plan, Store
from policies.migration import Blocklist, mark_preempted, refusal_key
from policies.models import (
    Accelerator,
    CheckpointSpec,
    JobSpec,
    Market,
    Pool,
    SpotPolicy,
)
from policies.placement import PlacementRequest, PlacementResult, place
from providers import catalog
from providers.aws.provider import AwsProvider
from providers.base import LaunchRequest, NodeState, ProviderError, Quota, share
from providers.fleet import CloudConfig, FleetFile, FleetProvider, build_fleet_provider, cloud_pools
from providers.local.provider import LocalProvider
from tests import builders
from tests.cloud_env import aws_quotas, ec2_refuses, no_cloud_config, record_launches
from tests.redis_server import RedisServer

SECRET = "wJalrXUtnFEMI-not-a-real-secret"
IMAGE = "ami-12c6146b"
LOCAL = """
grace_period_s: 1
regions:
  - {cloud: local, region: lab, market: spot, accelerator: V100, price_per_gpu_hour: 3.0, gpus: 2}
"""
CLOUDS = """
clouds:
  aws:
    regions: [us-east-1, us-west-2]
    accelerators: [V100]
    markets: [spot, on-demand]
    max_gpus: 2
    options: {image_id: ami-12c6146b, broker_id: unit}
  gcp:
    regions: [us-central1]
"""


@pytest.fixture(autouse=True)
def cloud_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS keys only where a test sets them; no GCP or Azure configuration at all."""
    no_cloud_config(monkeypatch, tmp_path)
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path / "config"))


def aws_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFLEETUNIT")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)


def fleet_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def mixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetProvider]:
    """Local pretend region 'lab' plus AWS (moto, in process); gcp declared but unconfigured."""
    aws_keys(monkeypatch)
    with mock_aws():
        provider, _ = build_fleet_provider(fleet_file(tmp_path, LOCAL + CLOUDS),
                                           tmp_path / "state", tmp_path)
        yield provider
        for node in provider.nodes():
            provider.terminate(node.node_id)


def request(key: str, cloud: str, region: str, market: Market = Market.SPOT) -> LaunchRequest:
    return LaunchRequest(idempotency_key=key, job_id=key.split(":")[0], cloud=cloud,
                         region=region, accelerator=Accelerator.V100, gpus_per_node=1,
                         market=market, command=["sh", "-c", "sleep 30"])


def test_the_clouds_name_a_checkpoint_buckets_region(mixed: FleetProvider) -> None:
    s3 = boto3.client("s3", region_name="us-east-1")
    s3.create_bucket(Bucket="ck-eu", CreateBucketConfiguration={
        "LocationConstraint": "eu-west-1"})
    s3.create_bucket(Bucket="ck-us")  # no constraint: us-east-1
    assert mixed.bucket_region("s3://ck-eu/runs/7") == "aws:eu-west-1"
    assert mixed.bucket_region("s3://ck-us") == "aws:us-east-1"
    assert mixed.bucket_region("s3://nobody-has-this-bucket/x") is None
    assert mixed.bucket_region("gs://ck-eu/runs/7") is None  # no GCP backend here


def test_the_leader_records_where_a_waiting_jobs_checkpoint_bucket_is(
        mixed: FleetProvider, redis_server: RedisServer, tmp_path: Path) -> None:
    """A spec with an s3:// checkpoint and no ``checkpoint.region``: the leader asks AWS once
    and records the bucket's region on the job, so placement prices restores and writes."""
    boto3.client("s3", region_name="us-east-1").create_bucket(
        Bucket="ck-eu", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    store = Store.from_url(redis_server.url)
    broker = Broker(BrokerConfig(state_dir=tmp_path / "b", redis_url=redis_server.url), store,
                    mixed)
    base = spec("located")
    h100 = base.model_copy(update={  # no pool sells H100 here: the job stays queued
        "accelerators": [Accelerator.H100],
        "checkpoint": base.checkpoint.model_copy(update={"uri": "s3://ck-eu/located"})})
    job = store.submit(h100, team="t")
    other = store.submit(h100.model_copy(update={"checkpoint": h100.checkpoint.model_copy(
        update={"uri": "s3://nobody-has-this-bucket/x"})}), team="t")
    broker.step()
    broker.step()
    located = store.get_job(job.id)
    assert located is not None and located.spec.checkpoint.region == "aws:eu-west-1"
    assert [e.data["region"] for e in store.events(job_id=job.id)
            if e.type == "checkpoint-located"] == ["aws:eu-west-1"]  # once
    assert store.get_job(other.id).spec.checkpoint.region is None  # type: ignore[union-attr]


# ---- fleet files ----------------------------------------------------------------------------


def test_fleet_file_with_clouds_and_local_regions(tmp_path: Path) -> None:
    fleet = FleetFile.load(fleet_file(tmp_path, LOCAL + CLOUDS))
    assert sorted(fleet.clouds) == ["aws", "gcp"]
    assert fleet.clouds["aws"].regions == ["us-east-1", "us-west-2"]
    assert fleet.clouds["gcp"].accelerators == [Accelerator.T4]  # the defaults
    local = fleet.local_fleet()
    assert local is not None and [r.region for r in local.regions] == ["lab"]
    assert FleetFile.load(fleet_file(tmp_path, CLOUDS)).local_fleet() is None


def test_cloud_pools_offer_the_instance_sizes_of_their_region() -> None:
    offers = [o for o in catalog.load_offers(("aws",)) if o.region == "us-east-1"]
    config = CloudConfig(regions=["us-east-1"], accelerators=[Accelerator.V100],
                         markets=[Market.SPOT], max_gpus=4)
    (v100,) = cloud_pools("aws", config, offers)
    assert v100.gpu_counts == (1, 4)  # p3.2xlarge and p3.8xlarge; p3.16xlarge holds 8 > 4
    assert v100.capacity == 4 and not v100.launchable(2)
    for n in (1, 4):  # each size at its own cheapest type's price per GPU
        want = min(o.hourly(Market.SPOT) / n for o in offers if o.accelerator is Accelerator.V100
                   and o.accelerator_count == n and o.hourly(Market.SPOT) is not None)
        assert v100.price_for(n) == pytest.approx(want, abs=1e-6)
    assert v100.price_per_gpu_hour == min(v100.gpu_prices.values())  # type: ignore[union-attr]


def test_pools_share_a_family_quota_and_keep_the_gpus_the_broker_holds() -> None:
    offers = [o for o in catalog.load_offers(("aws",)) if o.region == "us-east-1"]
    config = CloudConfig(regions=["us-east-1"], accelerators=[Accelerator.V100, Accelerator.A100],
                         markets=[Market.SPOT], max_gpus=8)
    v100, a100, h100 = (f"aws:us-east-1:spot:{a}" for a in ("V100", "A100", "H100"))
    # A 96-vCPU spot P quota; the broker's two 1-GPU p3.2xlarge nodes use 16 of it.
    family = Quota(free=96 - 16, per_gpu={v100: 8, a100: 12, h100: 24})
    pools = {p.id: p for p in cloud_pools("aws", config, offers, [family], {v100: 2})}
    # The 80 free vCPUs go out in whole instances to the two declared pools (H100 is not in
    # this fleet): an A100 instance (p4d, 8 GPUs, 96 vCPUs) does not fit, so V100 takes a
    # p3.16xlarge would not fit its cap (max_gpus 8 less the 2 it holds): it is dealt 6 GPUs
    # (p3.8xlarge and two p3.2xlarge) and holds 2 + 6 = 8.
    assert pools[a100].gpu_counts == (8,) and pools[a100].nodes == 0
    assert pools[v100].capacity == 8
    alone = CloudConfig(regions=["us-east-1"], accelerators=[Accelerator.V100],
                        markets=[Market.SPOT], max_gpus=8)
    (v,) = cloud_pools("aws", alone, offers, [family], {v100: 2})
    assert v.capacity == 8  # the whole family (2 + 80 // 8 = 12), capped at max_gpus


def test_a_family_quota_is_split_in_whole_instances_biggest_first() -> None:
    """96 free vCPUs of a P family: pool "four" launches p3.8xlarge (4 GPUs, 32 vCPUs), pool
    "eight" p3.16xlarge (8 GPUs, 64 vCPUs), 8 vCPUs a GPU in both. An even split (48 each, 6
    GPUs) starves the 8-GPU instance; in whole instances, biggest first, "eight" gets one (64)
    and "four" one (32): all 96 vCPUs, each pool a launchable count."""
    family = Quota(free=96, per_gpu={"eight": 8, "four": 8})
    sizes = {"eight": [8], "four": [4]}
    assert share([family], sizes=sizes) == {"eight": 8, "four": 4}
    # 160 vCPUs: the second round starts with the biggest instance again (64 of the 64 left)
    assert share([Quota(free=160, per_gpu=family.per_gpu)], sizes=sizes) == {"eight": 16,
                                                                            "four": 4}
    # a pool of several sizes takes the largest that what is left holds (p3: 1, 4 or 8 GPUs)
    assert share([Quota(free=80, per_gpu={"p3": 8})], sizes={"p3": [1, 4, 8]}) == {"p3": 10}
    # each size charged its instance's own vCPUs: 72 hold no 4-GPU NC96ads_A100_v4 (96) though
    # 4 x 12 (the fewest a GPU, ND96asr_v4's) is 48; they hold three 1-GPU NC24ads (24 each)
    a100 = Quota(free=72, per_gpu={"a100": 12}, per_instance={"a100": {1: 24, 4: 96, 8: 96}})
    assert share([a100], sizes={"a100": [1, 4, 8]}) == {"a100": 3}
    # sizes unknown: one GPU an instance, dealt in turn (a GCP GPU quota: 1 unit a GPU)
    assert share([Quota(free=7, per_gpu={"a": 1, "b": 1})]) == {"a": 4, "b": 3}
    # a pool the fleet caps (max_gpus less what it holds) is dealt no more: the rest goes on
    # to the others instead of being promised to a pool that cannot use it
    assert share([Quota(free=160, per_gpu=family.per_gpu)], sizes=sizes,
                 caps={"eight": 8}) == {"eight": 8, "four": 12}


def test_example_fleet_files_load() -> None:
    examples = sorted((Path(__file__).parent.parent / "examples" / "fleets").glob("*.yaml"))
    loaded = {p.name: FleetFile.load(p) for p in examples}
    assert sorted(loaded["clouds.yaml"].clouds) == ["aws", "gcp"]
    assert loaded["local.yaml"].local_fleet() is not None and not loaded["local.yaml"].clouds


@pytest.mark.parametrize(("text", "message"), [
    ("clouds: {ibm: {regions: [x]}}", "clouds: .*unknown cloud 'ibm'; use one of: aws, gcp"),
    ("clouds: {aws: {regions: []}}", "clouds.aws.regions: List should have at least 1 item"),
    ("clouds: {aws: {regions: [a], options: {aws_secret_access_key: x}}}",
     "look like credentials; remove them and use the cloud's standard credential chain"),
    ("regions:\n  - {cloud: aws, region: r, price_per_gpu_hour: 1, gpus: 1}\n"
     "clouds: {aws: {regions: [us-east-1]}}", "regions.0.cloud: 'aws' is also declared"),
    ("name: empty", "declare local pretend regions under `regions:` or real clouds"),
])
def test_bad_fleet_files_name_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        FleetFile.load(fleet_file(tmp_path, text))
    assert str(err.value).startswith(str(tmp_path / "fleet.yaml"))


def test_an_option_the_provider_does_not_take_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    aws_keys(monkeypatch)
    path = fleet_file(tmp_path, "clouds: {aws: {regions: [us-east-1], options: {imageid: x}}}")
    with pytest.raises(ValueError, match=r"clouds: options: .*unexpected keyword .*imageid"):
        build_fleet_provider(path, tmp_path, tmp_path)


# ---- skipping unconfigured clouds -------------------------------------------------------------


def test_unconfigured_cloud_is_skipped_with_one_line_and_the_others_are_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    aws_keys(monkeypatch)
    with caplog.at_level(logging.DEBUG):  # the real credential chain: no moto in between
        provider, skipped = build_fleet_provider(fleet_file(tmp_path, LOCAL + CLOUDS),
                                                 tmp_path / "state", tmp_path)
    with mock_aws():
        pools = {p.id: p for p in provider.pools()}
    assert list(skipped) == ["gcp"] and "gcp is not configured" in skipped["gcp"]
    lines = [r.getMessage() for r in caplog.records if "gcp" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("skipping gcp: gcp is not configured")
    assert "gcloud auth application-default login" in lines[0]  # the fix
    assert SECRET not in caplog.text and "AKIAFLEETUNIT" not in caplog.text
    assert sorted(provider.clouds) == ["aws"] and provider.local is not None
    # pools: the local region, and AWS's priced from its catalog, capped at max_gpus
    assert pools["local:lab:spot:V100"].capacity == 2
    east = pools["aws:us-east-1:spot:V100"]
    assert (east.capacity, east.price_per_gpu_hour) == (2, 0.5197)  # cheapest 1x V100 spot
    assert pools["aws:us-west-2:spot:V100"].price_per_gpu_hour == 0.9362
    assert pools["aws:us-east-1:on-demand:V100"].price_per_gpu_hour == 3.06
    assert not any(p.cloud == "gcp" for p in pools.values())


def test_every_cloud_unconfigured_leaves_the_local_regions(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        provider, skipped = build_fleet_provider(fleet_file(tmp_path, LOCAL + CLOUDS),
                                                 tmp_path / "state", tmp_path)
    assert sorted(skipped) == ["aws", "gcp"]
    assert [p.id for p in provider.pools()] == ["local:lab:spot:V100"]
    assert any(r.getMessage().startswith("skipping aws: aws is not configured: boto3 found no "
                                         "credentials") for r in caplog.records)


# ---- routing ----------------------------------------------------------------------------------


def test_launch_routes_by_cloud_and_the_rest_by_owner(mixed: FleetProvider) -> None:
    (vm,) = mixed.launch(request("a:1:1", "aws", "us-west-2"))
    (proc,) = mixed.launch(request("b:1:1", "local", "lab"))
    assert vm.provider == "aws" and vm.node_id.startswith("us-west-2/i-")
    assert proc.provider == "local" and proc.region == "lab"
    assert {n.node_id for n in mixed.nodes()} == {vm.node_id, proc.node_id}
    assert mixed.outlives_agent(vm) and not mixed.outlives_agent(proc)
    assert mixed.for_cloud("aws").starts_agent and not mixed.for_cloud("local").starts_agent
    assert isinstance(mixed.for_cloud("aws"), AwsProvider)
    assert isinstance(mixed.for_cloud("local"), LocalProvider)
    # a fresh composite over the same backends (a restarted broker) still finds the owner
    fresh = FleetProvider(mixed.local, mixed.clouds, mixed.configs)
    fresh.terminate(vm.node_id)
    states = {n.node_id: n.state for n in mixed.nodes()}
    assert states.get(vm.node_id, NodeState.TERMINATED) is NodeState.TERMINATED
    fresh.terminate("us-east-1/i-00000000000000000")  # unknown everywhere: already gone
    with pytest.raises(ProviderError, match="no provider serves cloud 'azure'"):
        mixed.launch(request("c:1:1", "azure", "eastus"))
    with pytest.raises(ValueError, match="local pretend regions only"):
        FleetProvider(None, mixed.clouds, mixed.configs).reclaim("us-east-1")


def test_a_cloud_that_stops_answering_leaves_its_jobs_alone(
        mixed: FleetProvider, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store.from_url(redis_server.url)
    fence = store.acquire_lease("me", 60)
    store.set_pools(mixed.pools())
    job = store.submit(spec("on-aws", accelerators=[Accelerator.V100]),
                       team="t")
    Scheduler(store).run_round(fence)
    Actuator(store, mixed, ActuatorConfig(use_agent=False)).run(fence)
    running = store.get_job(job.id)
    assert running is not None and running.pool == "aws:us-east-1:spot:V100"
    reconciler = Reconciler(store, mixed)

    def outage(self: AwsProvider) -> list:
        raise ProviderError("aws describe_instances in us-east-1: endpoint unreachable")

    with monkeypatch.context() as m:
        m.setattr(AwsProvider, "nodes", outage)
        assert [n.provider for n in mixed.nodes()] == []  # the local region has no nodes
        assert mixed.unreachable() == {"aws"}
        reconciler.run(fence)
        assert store.get_job(job.id).state is JobState.RUNNING  # type: ignore[union-attr]
    mixed.for_cloud("aws").terminate(running.node_ids[0])  # gone while nobody could see
    reconciler.run(fence)
    assert mixed.unreachable() == frozenset()
    lost = store.get_job(job.id)
    assert lost is not None and lost.state is JobState.SUSPENDED and lost.reason == "node lost"


# ---- the blocklist ----------------------------------------------------------------------------


def spot_fleet(tmp_path: Path) -> Path:
    return fleet_file(tmp_path, """
grace_period_s: 1
regions:
  - {cloud: local, region: a, market: spot, price_per_gpu_hour: 0.1, gpus: 1}
  - {cloud: local, region: b, market: spot, price_per_gpu_hour: 0.2, gpus: 1}
  - {cloud: local, region: c, market: spot, price_per_gpu_hour: 0.3, gpus: 1}
  - {cloud: local, region: d, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}
""")


# The jobs here prefer spot, checkpoint (exit 75) when told to stop, and are small.
spec = partial(builders.spec, run="trap 'exit 75' TERM; sleep 30 & wait",
               spot=SpotPolicy.PREFERRED, batch=8, samples=100)


def test_blocklist_is_kept_in_redis_and_written_only_over_what_was_read(
        redis_server: RedisServer) -> None:
    store = Store.from_url(redis_server.url)
    fence = store.acquire_lease("me", 30)
    empty, read = store.blocklist(decay_s=600)
    assert read is None and empty.decay_s == 600
    marked = mark_preempted(empty.model_copy(update={"locations": ["x:1", "x:2", "x:3"]}),
                            "x:1", time.time())
    plan = Plan()
    plan.set_blocklist(marked, read=read)
    store.apply(plan, fence=fence)
    stale = Plan()
    stale.set_blocklist(empty, read=None)  # derived from a read that is no longer current
    with pytest.raises(Conflict):
        store.apply(stale, fence=fence)
    redis_server.restart(kill=False)  # a broker restart (and a Redis restart) keep it
    again, _ = Store.from_url(redis_server.url).blocklist()
    assert again == marked and again.is_blocked("x:1", time.time())
    # the broker's setting, not the stored one, decides how long a mark lasts
    shorter, _ = Store.from_url(redis_server.url).blocklist(decay_s=1.0)
    assert shorter.decay_s == 1.0 and not shorter.is_blocked("x:1", time.time() + 2)


def test_agent_reports_belong_to_one_attempt(store: Store) -> None:
    job = store.submit(spec("reported"), team="t")
    before = time.time()
    store.record_heartbeat(job.id, 0, samples_done=5, notice="aws spot instance-action")
    first = time.time()
    store.record_heartbeat(job.id, 0, exit_code=75)
    store.record_heartbeat(job.id, 3, exit_code=0)  # a stale attempt writes nothing
    report = store.agent_reports([job])[job.id]
    assert (report.exit_code, report.notice) == (75, "aws spot instance-action")
    assert report.first_beat is not None and before <= report.first_beat <= first
    relaunched = job.model_copy(update={"attempt": 1})
    assert store.agent_reports([relaunched]) == {}  # the next attempt starts with no report


def test_notice_blocks_the_spot_location_and_the_job_resumes_elsewhere(
        redis_server: RedisServer, tmp_path: Path) -> None:
    provider, _ = build_fleet_provider(spot_fleet(tmp_path), tmp_path / "state", tmp_path)
    store = Store.from_url(redis_server.url)
    actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
    scheduler = Scheduler(store, SchedulerConfig())
    reconciler = Reconciler(store, provider, blocklist_decay_s=900)
    fence = store.acquire_lease("me", 60)

    def step() -> None:
        store.set_pools(provider.pools())
        reconciler.run(fence)
        scheduler.run_round(fence)
        actuator.run(fence)

    try:
        job = store.submit(spec("mover"), team="t")
        step()
        first = store.get_job(job.id)
        assert first is not None and first.pool == "local:a:spot:T4"
        provider.reclaim("a", duration_s=0.5)  # the notice; capacity is back in 0.5 s
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and store.get_job(job.id).attempt < 2:  # type: ignore
            step()
            time.sleep(0.1)
        time.sleep(0.6)
        step()
        moved = store.get_job(job.id)
        assert moved is not None and moved.pool == "local:b:spot:T4"  # not back to a
        assert moved.preemptions == 1 and moved.migrations == 1
        blocklist, _ = store.blocklist()
        assert blocklist.decay_s == 900 and blocklist.is_blocked("local:a", time.time())
        assert set(blocklist.active(time.time())) == {"local:b", "local:c"}
        blocked = [e for e in store.events(job_id=job.id) if e.type == "location-blocked"]
        assert blocked[0].data["location"] == "local:a" and blocked[0].data["blocked"]
        # a newcomer does not go to the blocked location either, though it is cheapest again
        other = store.submit(spec("newcomer"), team="t")
        step()
        assert store.get_job(other.id).pool == "local:c:spot:T4"  # type: ignore[union-attr]
        # with every other pool full, the blocked one is the last resort; the launch there
        # succeeds, so SpotHedge's mark_launched makes it active again
        late = [store.submit(spec(n), team="t").id for n in ("third", "fourth")]
        step()
        where = {store.get_job(i).pool: i for i in late}  # type: ignore[union-attr]
        assert sorted(where) == ["local:a:spot:T4", "local:d:on-demand:T4"]
        blocklist, _ = store.blocklist()
        assert not blocklist.is_blocked("local:a", time.time())
        (back,) = [e for e in store.events(job_id=where["local:a:spot:T4"])
                   if e.type == "location-active"]
        assert back.data == {"locations": ["local:a"], "pool": "local:a:spot:T4"}
    finally:
        for node in provider.nodes():
            provider.terminate(node.node_id)


def test_blocked_spot_locations_leave_on_demand_and_running_jobs_alone() -> None:
    pools = [Pool(cloud="aws", region=r, market=m, accelerator=Accelerator.T4, nodes=1,
                  gpus_per_node=1, price_per_gpu_hour=price)
             for r, m, price in (("r", Market.SPOT, 0.1), ("r", Market.ON_DEMAND, 0.5),
                                 ("s", Market.SPOT, 0.2))]
    blocklist = Blocklist(locations=["aws:r", "aws:s", "aws:t"], preempted={"aws:r": 100.0})
    blocked = blocked_pools(pools, blocklist, now=200.0)
    assert blocked == {"aws:r:spot:T4"}  # a reclaim says nothing about on-demand
    assert blocked_pools(pools, blocklist, now=100.0 + blocklist.decay_s) == frozenset()
    assert blocked_pools(pools, None, now=0.0) == frozenset()
    placed = place([PlacementRequest("runs", 1, current_pool="aws:r:spot:T4", blocked=blocked),
                    PlacementRequest("new", 1, blocked=blocked)], pools)
    assert placed["runs"] == PlacementResult("aws:r:spot:T4", 1)  # stays where it runs
    assert placed["new"] == PlacementResult("aws:s:spot:T4", 1)  # not the cheaper blocked one


# ---- observed preemptions steer placement (policies.region_score through policies.placement) --


def test_counted_preemptions_steer_long_jobs_away_and_survive_a_restart(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """One reclaim in the cheapest pool makes the broker expect about one a day there: a long job
    (checkpointing hourly) then goes to a pool 1% dearer; a short one still takes the cheap one.
    With two spot locations SpotHedge's blocklist resets at once, so the counts alone steer."""
    provider, _ = build_fleet_provider(fleet_file(tmp_path, """
grace_period_s: 1
regions:
  - {cloud: local, region: a, market: spot, price_per_gpu_hour: 0.100, gpus: 2}
  - {cloud: local, region: b, market: spot, price_per_gpu_hour: 0.101, gpus: 2}
"""), tmp_path / "state", tmp_path)
    cheap, dear = "local:a:spot:T4", "local:b:spot:T4"

    def job(name: str, samples: int) -> JobSpec:
        return spec(name, spot=SpotPolicy.ALLOWED).model_copy(update={
            "work_samples": samples, "checkpoint": CheckpointSpec(interval="3600s")})

    store = Store.from_url(redis_server.url)
    actuator = Actuator(store, provider, ActuatorConfig(use_agent=False))
    reconciler = Reconciler(store, provider)
    fence = store.acquire_lease("me", 60)

    def step(scheduler: Scheduler) -> None:
        store.set_pools(provider.pools())
        reconciler.run(fence)
        scheduler.run_round(fence)
        actuator.run(fence)

    try:
        scheduler = Scheduler(store, priors=provider.interruption_priors)
        victim = store.submit(job("victim", 10**9), team="t")
        step(scheduler)
        assert store.get_job(victim.id).pool == cheap  # type: ignore[union-attr]
        provider.reclaim("a", duration_s=0.3)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and store.get_job(victim.id).attempt < 2:  # type: ignore
            step(scheduler)
            time.sleep(0.1)
        assert store.get_job(victim.id).pool == dear  # type: ignore[union-attr]
        stats = store.pool_stats()
        assert stats.preemptions == {cheap: 1} and stats.node_hours[cheap] > 0
        assert not store.blocklist()[0].is_blocked("local:a", time.time())
        time.sleep(0.3)  # region a has its GPUs back

        redis_server.restart(kill=False)  # a broker restart over a restarted Redis
        store = Store.from_url(redis_server.url)
        fence = store.acquire_lease("me", 60)
        assert store.pool_stats() == stats
        store.set_pools(provider.pools())
        long, short = (store.submit(job(n, s), team="t") for n, s in (("long", 10**9),
                                                                      ("short", 100)))
        Scheduler(store, priors=provider.interruption_priors).run_round(fence)
        assert store.get_job(long.id).pool == dear  # type: ignore[union-attr]
        assert store.get_job(short.id).pool == cheap  # type: ignore[union-attr]
    finally:
        for node in provider.nodes():
            provider.terminate(node.node_id)


def test_pool_priors_come_from_the_spot_advisor_once_per_fleet(
        mixed: FleetProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    pools = mixed.pools()
    priors = mixed.interruption_priors(pools)
    advisor = catalog.interruption_priors()
    # the type whose price the pool carries: the cheapest 1x V100 spot there (p3.2xlarge)
    assert priors["aws:us-east-1:spot:V100"] == advisor[("us-east-1", "p3.2xlarge")]
    assert priors["aws:us-west-2:spot:V100"] == advisor[("us-west-2", "p3.2xlarge")]
    assert "local:lab:spot:V100" not in priors  # no advisor data: the round's unknown rate
    monkeypatch.setattr("providers.fleet.interruption_priors", lambda: pytest.fail("read again"))
    assert mixed.interruption_priors(pools) == priors


# ---- AWS quotas, refused launches and the AZ a spot launch goes to (moto) ----------------------

EAST, WEST = "aws:us-east-1:spot:V100", "aws:us-west-2:spot:V100"
SPOT_P = "L-7212CCBC"  # the spot P-family vCPU quota


@pytest.fixture
def aws_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FleetProvider]:
    """AWS spot V100 in us-east-1 (cheaper) and us-west-2, on moto; pools re-read every pass."""
    aws_keys(monkeypatch)
    with mock_aws():
        provider, _ = build_fleet_provider(fleet_file(tmp_path, """
grace_period_s: 1
clouds:
  aws:
    regions: [us-east-1, us-west-2]
    accelerators: [V100]
    markets: [spot]
    max_gpus: 2
    options: {image_id: ami-12c6146b, broker_id: unit}
"""), tmp_path / "state", tmp_path)
        provider.pool_ttl_s = 0
        yield provider
        for node in provider.nodes():
            provider.terminate(node.node_id)


def broker_pass(store: Store, provider: FleetProvider, fence: int) -> None:
    """One pass of the leader loop (``broker.server.Broker.step``)."""
    store.set_pools(provider.pools())
    Reconciler(store, provider).run(fence)
    Scheduler(store).run_round(fence)
    Actuator(store, provider, ActuatorConfig(use_agent=False)).run(fence)


def test_a_running_job_keeps_its_pool_when_the_quota_has_no_headroom_left(
        aws_fleet: FleetProvider, store: Store) -> None:
    fence = store.acquire_lease("me", 60)
    job = store.submit(spec("stays", accelerators=[Accelerator.V100]), team="t")
    broker_pass(store, aws_fleet, fence)
    running = store.get_job(job.id)
    assert running is not None and running.state is JobState.RUNNING and running.pool == EAST
    # The launch went to the AZ whose price the pool carries and the placement recorded:
    # use1-az1 (us-east-1b on moto), $0.5197 for a p3.2xlarge, the region's cheapest.
    (node,) = aws_fleet.nodes()
    assert node.zone == "us-east-1b"
    assert [p.price_per_gpu_hour for p in store.placements(job.id)] == [0.5197]
    # Now the spot P quota in us-east-1 is exactly the 8 vCPUs the job's instance uses.
    aws = aws_fleet.for_cloud("aws")
    assert isinstance(aws, AwsProvider)
    aws_quotas(aws._client("service-quotas", "us-east-1"), {SPOT_P: 8.0})
    aws_quotas(aws._client("service-quotas", "us-west-2"), {SPOT_P: 64.0})
    broker_pass(store, aws_fleet, fence)
    pools = {p.id: p.capacity for p in store.pools()}
    assert pools == {EAST: 1, WEST: 2}  # the GPU the job holds (headroom 0), and max_gpus
    stayed = store.get_job(job.id)
    assert stayed is not None and stayed.state is JobState.RUNNING
    assert (stayed.pool, stayed.attempt, stayed.migrations) == (EAST, 1, 0)
    assert store.intents() == []  # no MIGRATE, no SUSPEND
    newcomer = store.submit(spec("newcomer", accelerators=[Accelerator.V100]), team="t")
    broker_pass(store, aws_fleet, fence)
    assert store.get_job(newcomer.id).pool == WEST  # type: ignore[union-attr]
    assert store.get_job(job.id).pool == EAST  # type: ignore[union-attr]


@pytest.mark.parametrize(("max_failures", "then"), [(3, JobState.SUSPENDED),
                                                    (0, JobState.FAILED)])
def test_a_vm_whose_agent_never_reports_is_terminated_at_the_launch_deadline(
        aws_fleet: FleetProvider, store: Store, max_failures: int, then: JobState) -> None:
    """An agent that never sent a first heartbeat (broken image, start script or network) does
    not hold its VM forever: past ``launch_deadline_s`` the VM goes and the job is requeued,
    a counted failure (a launch that never comes up is not retried forever). One that reported
    is left alone however long it runs."""
    fence = store.acquire_lease("me", 60)
    silent, talks, old = (store.submit(spec(n, accelerators=[Accelerator.V100]), team="t")
                          for n in ("silent", "talks", "old"))
    broker_pass(store, aws_fleet, fence)
    jobs = {j.id: j for j in map(store.get_job, (silent.id, talks.id, old.id)) if j}
    assert {j.state for j in jobs.values()} == {JobState.RUNNING}
    store.record_heartbeat(talks.id, jobs[talks.id].attempt, samples_done=1,
                           launch_key=jobs[talks.id].launch_key)
    # an agent that reported to a broker from before the first-beat record: only its job's
    # last heartbeat says so (the first start of a new broker must not kill it)
    store.record_heartbeat(old.id, jobs[old.id].attempt, samples_done=1,
                           launch_key=jobs[old.id].launch_key)
    store.r.hdel(f"{store.p}progress:{old.id}", f"beat:{jobs[old.id].attempt}")
    launched = max(j.launched_at or 0.0 for j in jobs.values())
    now = [launched + 1199.0]
    reconciler = Reconciler(store, aws_fleet, max_failures=max_failures, launch_deadline_s=1200,
                            clock=lambda: now[0])
    assert reconciler.run(fence).abandoned == 0  # not yet
    now[0] = launched + 1201.0
    assert reconciler.run(fence).abandoned == 1
    live = {n.job_id for n in aws_fleet.nodes() if n.state is not NodeState.TERMINATED}
    assert live == {talks.id, old.id}
    reconciler.run(fence)  # the node is gone: the job settles, back in the queue
    requeued = store.get_job(silent.id)
    assert requeued is not None and requeued.state is then
    assert requeued.reason == ("no heartbeat from the agent within 1200 s of launch; nodes "
                               "terminated, job requeued") and requeued.failures == 1
    assert [p.end is not None for p in store.placements(silent.id)] == [True]
    assert [e.data["deadline_s"] for e in store.events(job_id=silent.id)
            if e.type == "launch-deadline"] == [1200]
    assert store.get_job(talks.id).state is JobState.RUNNING  # type: ignore[union-attr]
    assert store.get_job(old.id).state is JobState.RUNNING  # type: ignore[union-attr]


def test_a_failing_terminate_stalls_nothing_and_a_lost_record_still_counts_a_failure(
        aws_fleet: FleetProvider, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cloud refuses to terminate one silent VM: the pass goes on (the other job is
    settled) and retries it next time. A silent VM terminated whose record did not land is
    settled as the launch failure it was, not as a reclaim."""
    fence = store.acquire_lease("me", 60)
    stuck, lost = (store.submit(spec(n, accelerators=[Accelerator.V100]), team="t")
                   for n in ("stuck", "lost"))
    broker_pass(store, aws_fleet, fence)
    jobs = {j.id: j for j in map(store.get_job, (stuck.id, lost.id)) if j}
    for node_id in jobs[lost.id].node_ids:  # as if _abandon's record had not landed
        aws_fleet.terminate(node_id)
    launched = max(j.launched_at or 0.0 for j in jobs.values())
    reconciler = Reconciler(store, aws_fleet, launch_deadline_s=1200,
                            clock=lambda: launched + 1201.0)
    real = aws_fleet.terminate

    def refuse(node_id: str) -> None:
        if node_id in jobs[stuck.id].node_ids:
            raise ProviderError("aws terminate_instances: OperationNotPermitted")
        real(node_id)

    monkeypatch.setattr(aws_fleet, "terminate", refuse)
    assert reconciler.run(fence).abandoned == 0  # refused: nothing recorded, no exception
    settled = store.get_job(lost.id)
    assert settled is not None and settled.state is JobState.SUSPENDED
    assert (settled.failures, settled.preemptions) == (1, 0)
    assert settled.reason.startswith("no heartbeat from the agent within 1200 s")
    assert store.pool_stats().preemptions == {}
    monkeypatch.setattr(aws_fleet, "terminate", real)
    assert reconciler.run(fence).abandoned == 1  # retried


def test_a_launch_that_falls_back_to_a_dearer_az_records_that_azs_price(
        aws_fleet: FleetProvider, store: Store) -> None:
    """The pool carries use1-az1's $0.5197 (us-east-1b on moto). With no capacity there, that
    attempt is refused and marks only that AZ: the pool stays usable, and the next round's
    attempt (a new key) lands in use1-az6 (us-east-1a), $0.6827, the price the job is counted
    at. One launch, one AZ, one ``ClientToken``: a retry can never start a second instance."""
    aws = aws_fleet.for_cloud("aws")
    assert isinstance(aws, AwsProvider)
    ec2_refuses(aws._client("ec2", "us-east-1"), "InsufficientInstanceCapacity", "us-east-1b")
    fence = store.acquire_lease("me", 60)
    job = store.submit(spec("fallback", accelerators=[Accelerator.V100]), team="t")
    broker_pass(store, aws_fleet, fence)
    refused = store.get_job(job.id)
    assert refused is not None and refused.state is JobState.SUSPENDED
    assert (refused.failures, aws_fleet.nodes()) == (0, [])
    (event,) = [e for e in store.events(job_id=job.id) if e.type == "pool-refused"]
    assert (event.data["pool"], event.data["zone"]) == (EAST, "us-east-1b")
    blocklist, _ = store.blocklist()
    now = time.time()
    assert blocklist.is_refused(refusal_key(EAST, "us-east-1b"), now)
    assert not blocklist.is_refused(EAST, now)  # the pool itself is not blocked
    assert blocked_pools(store.pools(), blocklist, now) == frozenset()
    assert refused_pools(store.pools(), blocklist, now) == {}
    broker_pass(store, aws_fleet, fence)
    running = store.get_job(job.id)
    assert running is not None and running.state is JobState.RUNNING and running.pool == EAST
    assert (running.attempt, running.failures) == (2, 0)
    assert [n.zone for n in aws_fleet.nodes()] == ["us-east-1a"]
    assert [p.price_per_gpu_hour for p in store.placements(job.id)] == [0.6827]


# p3.2xlarge spot in us-east-1 (moto's names): use1-az1, az6, az5, az2, cheapest first
EAST_AZS = ["us-east-1b", "us-east-1a", "us-east-1f", "us-east-1c"]


@pytest.mark.parametrize(("code", "reason", "zones"), [
    ("InsufficientInstanceCapacity", "no capacity", [*EAST_AZS[:3], None]),
    ("VcpuLimitExceeded", "no quota", [None])])
def test_a_refused_launch_blocks_the_pool_and_the_job_launches_in_another(
        aws_fleet: FleetProvider, store: Store, code: str, reason: str,
        zones: list[str | None]) -> None:
    """A stock-out in every AZ: one attempt per priced AZ, each marking its AZ, the last one
    the pool; a quota is the region's, so its first refusal marks the pool."""
    aws = aws_fleet.for_cloud("aws")
    assert isinstance(aws, AwsProvider)
    east = aws._client("ec2", "us-east-1")
    east.meta.config.retries = {"max_attempts": 0}
    sent = record_launches(east)
    ec2_refuses(east, code)
    fence = store.acquire_lease("me", 60)
    job = store.submit(spec("refused", accelerators=[Accelerator.V100]), team="t")
    for _ in range(len(zones) + 4):  # before, the same pool each round: a quota error FAILED it
        broker_pass(store, aws_fleet, fence)
    done = store.get_job(job.id)
    assert done is not None and done.state is JobState.RUNNING and done.pool == WEST
    assert done.failures == 0 and done.attempt == len(zones) + 1
    assert list(sent) == EAST_AZS[:len(zones)]  # each AZ once, cheapest first
    refused = [e for e in store.events(job_id=job.id) if e.type == "pool-refused"]
    assert [(e.data["pool"], e.data["zone"], e.data["error"]) for e in refused] == \
        [(EAST, zone, reason) for zone in zones]
    suspended = [e for e in store.events(job_id=job.id) if e.data.get("to") == "suspended"]
    assert len(suspended) == len(zones)
    blocklist, _ = store.blocklist()
    now = time.time()
    assert blocklist.is_refused(EAST, now) and not blocklist.is_refused(WEST, now)
    assert f"no {blocklist.refusal_why[EAST]}" == reason  # what a job held back is told
    assert not blocklist.is_refused(EAST, now + blocklist.refusal_decay_s)  # a short mark
    # a newcomer does not try the refused pool either, while the other has room
    other = store.submit(spec("newcomer", accelerators=[Accelerator.V100]), team="t")
    broker_pass(store, aws_fleet, fence)
    assert store.get_job(other.id).pool == WEST  # type: ignore[union-attr]
