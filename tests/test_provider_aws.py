"""AWS provider on moto's EC2: launches, idempotency, tags, user data, errors, quotas, notices."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import boto3
import pytest
from moto import mock_aws
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.models import ec2_backends
from moto.server import ThreadedMotoServer

from policies.models import Accelerator, Market
from providers import bootstrap
from providers.aws.provider import AwsProvider
from providers.base import (
    CapacityError,
    LaunchRequest,
    NodeState,
    NotConfiguredError,
    ProviderError,
    QuotaError,
    replacement_key,
)
from tests.cloud_env import (
    aws_quotas,
    ec2_honours_client_tokens,
    ec2_refuses,
    fake_aws_keys,
    record_launches,
)

REGIONS = ["us-east-1", "us-west-2"]
IMAGE = "ami-12c6146b"  # moto accepts any AMI id; this one is in its default image list
_SESSION: list[boto3.Session] = []


def session() -> boto3.Session:
    """One boto3 session for all tests: its loader caches the service models (seconds each)."""
    if not _SESSION:
        _SESSION.append(boto3.Session())
    return _SESSION[0]


@pytest.fixture(autouse=True)
def aws_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_aws_keys(monkeypatch, tmp_path)


@pytest.fixture
def aws() -> Iterator[AwsProvider]:
    with mock_aws():
        yield AwsProvider(REGIONS, broker_id="test-broker", image_id=IMAGE, session=session())


def request(key: str = "job-1:7:0", market: Market = Market.SPOT, **kw) -> LaunchRequest:
    fields = {
        "idempotency_key": key, "job_id": "job-1", "region": "us-east-1",
        "accelerator": Accelerator.V100, "gpus_per_node": 1, "nodes": 2, "market": market,
        "env": {"FLEET_BROKER_URL": "http://broker:8080"},
        "command": ["python", "train.py", "--lr", "0.1"],
    }  # fmt: skip
    return LaunchRequest(**{**fields, **kw})


def _describe(instance_id: str, region: str = "us-east-1") -> dict:
    ec2 = session().client("ec2", region)
    return ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0]["Instances"][0]


def test_spot_launch_tags_user_data_and_client_token(aws: AwsProvider) -> None:
    req = request()
    nodes = aws.launch(req)
    assert len(nodes) == 2
    assert all(n.market is Market.SPOT and n.job_id == "job-1" for n in nodes)
    assert all(n.accelerator is Accelerator.V100 and n.gpus == 1 for n in nodes)
    region, _, iid = nodes[0].node_id.partition("/")
    inst = _describe(iid, region)
    assert inst["InstanceType"] == "p3.2xlarge"  # the catalog's only 1x V100 type
    assert inst["InstanceLifecycle"] == "spot"
    assert inst["ClientToken"] == bootstrap.token(req.idempotency_key)  # in any AZ
    tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
    assert tags[bootstrap.BROKER_TAG] == "test-broker" and tags[bootstrap.KEY_TAG] == "job-1:7:0"
    raw = (
        session()
        .client("ec2", region)
        .describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"]["Value"]
    )
    script = base64.b64decode(raw).decode()
    assert "\npython3 -m broker.runtime.agent -- python train.py --lr 0.1 &\n" in script
    behaviour = session().client("ec2", region).describe_instance_attribute(
        InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")
    assert behaviour["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    assert "export FLEET_JOB_ID=job-1" in script and "export FLEET_MARKET=spot" in script
    assert "export FLEET_BROKER_URL=http://broker:8080" in script
    assert "fleet_shutdown='shutdown -h now'\n" in script
    # the fleet file's `options: {shutdown_command: ""}`: the VM stays up after its job
    debug = AwsProvider(REGIONS, broker_id="test-broker", image_id=IMAGE, session=session(),
                        shutdown_command="")
    kept = debug.launch(request(key="job-1:7:9", nodes=1))[0].node_id.partition("/")[2]
    raw = session().client("ec2", region).describe_instance_attribute(
        InstanceId=kept, Attribute="userData")["UserData"]["Value"]
    assert "fleet_shutdown=''\n" in base64.b64decode(raw).decode()


def user_data(instance_id: str, region: str = "us-east-1") -> str:
    raw = session().client("ec2", region).describe_instance_attribute(
        InstanceId=instance_id, Attribute="userData")["UserData"]["Value"]
    return base64.b64decode(raw).decode()


def test_a_gang_is_one_request_whose_nodes_know_their_ranks(aws: AwsProvider) -> None:
    """Two nodes in one RunInstances (all or nothing, one AZ) with one user data: each works
    out its rank from its launch index (``bootstrap.rank_step``), and the inventory reports the
    same ranks from the first-rank tag and the instances' ``AmiLaunchIndex``."""
    req = request(env={"FLEET_NODE_RANK": "0"})  # a rank of the broker's is not every node's
    nodes = aws.launch(req)
    assert sorted(n.rank for n in nodes) == [0, 1]
    assert {n.rank for n in aws.nodes()} == {0, 1} and len({n.zone for n in nodes}) == 1
    instances = [_describe(n.node_id.partition("/")[2]) for n in nodes]
    assert len({i["ClientToken"] for i in instances}) == 1
    scripts = {user_data(i["InstanceId"]) for i in instances}
    (script,) = scripts  # one user data for both
    assert "export FLEET_FIRST_RANK=0\n" in script and "FLEET_NODE_RANK=0" not in script
    assert "/latest/meta-data/ami-launch-index" in script
    assert [n.node_id for n in aws.launch(req)] == [n.node_id for n in nodes]


def test_a_replacement_launch_is_one_node_of_the_lost_rank(aws: AwsProvider) -> None:
    """A lost node's stand-in: one node, rank 1, under a key with '~' and '.' (a tag value EC2
    filters on, and the ``ClientToken``'s input); relaunching it finds the same instance."""
    gang = aws.launch(request())
    key = replacement_key("job-1:7:0", 1, 1)
    req = request(key=key, nodes=1, first_rank=1)
    (node,) = aws.launch(req)
    assert node.rank == 1 and node.idempotency_key == key
    inst = _describe(node.node_id.partition("/")[2])
    assert inst["ClientToken"] == bootstrap.token(key)
    script = user_data(inst["InstanceId"])
    assert "export FLEET_NODE_RANK=1\n" in script and "ami-launch-index" not in script
    assert [n.node_id for n in aws.launch(req)] == [node.node_id]
    ranks = {n.node_id: n.rank for n in aws.nodes()}
    assert ranks == {**{n.node_id: n.rank for n in gang}, node.node_id: 1}
    assert sorted(ranks.values()) == [0, 1, 1]


def test_launch_is_idempotent_in_our_code(aws: AwsProvider) -> None:
    first = aws.launch(request())
    again = aws.launch(request())
    assert [n.node_id for n in again] == [n.node_id for n in first]
    other = aws.launch(request(key="job-1:7:1", market=Market.ON_DEMAND, nodes=1))
    assert other[0].market is Market.ON_DEMAND and other[0].node_id not in {
        n.node_id for n in first
    }
    assert len(aws.nodes()) == 3


def test_nodes_lists_only_this_brokers_instances_across_regions(aws: AwsProvider) -> None:
    aws.launch(request(region="us-west-2", nodes=1, key="k-west"))
    aws.launch(request(nodes=1, key="k-east"))
    foreign = AwsProvider(REGIONS, broker_id="someone-else", image_id=IMAGE, session=session())
    foreign.launch(request(nodes=1, key="k-foreign"))
    mine = aws.nodes()
    assert sorted(n.region for n in mine) == ["us-east-1", "us-west-2"]
    assert {n.idempotency_key for n in mine} == {"k-west", "k-east"}


def test_terminate_is_final_and_repeatable(aws: AwsProvider) -> None:
    node = aws.launch(request(nodes=1))[0]
    aws.terminate(node.node_id)
    aws.terminate(node.node_id)  # already gone: not an error
    aws.terminate("us-east-1/i-0123456789abcdef0")  # never existed: not an error
    assert all(n.state is NodeState.TERMINATED for n in aws.nodes() if n.node_id == node.node_id)
    # A terminated launch does not block a relaunch under a new attempt key.
    assert aws.launch(request(nodes=1, key="job-1:7:1"))[0].node_id != node.node_id


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("InsufficientInstanceCapacity", CapacityError),
        ("SpotMaxPriceTooLow", CapacityError),
        ("VcpuLimitExceeded", QuotaError),
        ("MaxSpotInstanceCountExceeded", QuotaError),
        ("UnauthorizedOperation", NotConfiguredError),
        ("InvalidParameterValue", ProviderError),
    ],
)
def test_ec2_errors_map_to_broker_errors(aws: AwsProvider, code: str, error: type) -> None:
    aws._client("ec2", "us-east-1").meta.config.retries = {"max_attempts": 0}
    ec2_refuses(aws._client("ec2", "us-east-1"), code)
    with pytest.raises(error, match=code):
        aws.launch(request())


def test_no_catalog_type_is_a_capacity_error(aws: AwsProvider) -> None:
    with pytest.raises(CapacityError, match="3x V100"):
        aws.launch(request(gpus_per_node=3))


def test_missing_credentials_name_the_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(NotConfiguredError, match=r"aws is not configured.*AWS_PROFILE"):
        AwsProvider(REGIONS)


def test_capacity_from_vcpu_quotas_shared_by_each_family(aws: AwsProvider) -> None:
    aws.launch(request(market=Market.ON_DEMAND, nodes=1))  # one p3.2xlarge = 8 vCPUs in use
    assert aws.capacity() == {}  # moto knows no EC2 quotas: headroom unknown, nothing claimed
    aws.regions = ["us-east-1"]
    aws_quotas(aws._client("service-quotas", "us-east-1"), {"L-417A185B": 64.0, "L-7212CCBC": 96.0})
    on_demand, spot = aws.quotas()  # the P family's on-demand and spot vCPUs; no G quota known
    pool = "aws:us-east-1:{}:{}".format
    assert on_demand.free == 64 - 8 and spot.free == 96  # the instance in use counts
    assert spot.per_gpu == {pool("spot", "V100"): 8, pool("spot", "A100"): 12,
                            pool("spot", "H100"): 24}  # p3.2xlarge, p4d.24xlarge / 8, p5 / 8
    cap = aws.capacity()
    # One budget per family, dealt in whole instances, biggest first: 96 spot vCPUs hold no
    # p5 (8 H100, 192 vCPUs) but one p4d (8 A100, 96), which takes them all; an even third each
    # (4 V100, 2 A100, 1 H100) gave the 8-GPU types counts they cannot launch. The 56 on-demand
    # vCPUs hold a p3.8xlarge (4 V100, 32) and three p3.2xlarge (8 each): 7 V100.
    assert [cap[pool("spot", a)] for a in ("V100", "A100", "H100")] == [0, 8, 0]
    assert [cap[pool("on-demand", a)] for a in ("V100", "A100", "H100")] == [7, 0, 0]
    for quota in (on_demand, spot):
        assert sum(cap[p] * vcpus for p, vcpus in quota.per_gpu.items()) <= quota.free


def test_spot_launch_goes_to_the_az_whose_price_the_pool_carries(aws: AwsProvider) -> None:
    east = aws.launch(request(nodes=1))[0]
    assert east.price_per_gpu_hour == 0.5197
    west = aws.launch(request(nodes=1, key="k-west", region="us-west-2"))[0]
    # use1-az1 has the cheapest p3.2xlarge spot price ($0.5197), usw2-az2 ($0.9362); moto names
    # them us-east-1b and us-west-2a (unpinned, moto and EC2 may pick any AZ).
    assert (east.zone, west.zone) == ("us-east-1b", "us-west-2a")
    prices = {o.zone: o.spot_price for o in aws.offers()
              if o.instance_type == "p3.2xlarge" and o.spot_price is not None}
    assert min(prices, key=prices.__getitem__) == "use1-az1"
    assert _describe(east.node_id.partition("/")[2])["Placement"]["AvailabilityZone"] == \
        "us-east-1b"
    named = aws.launch(request(nodes=1, key="k-named", zone="us-east-1d"))[0]
    assert named.zone == "us-east-1d"  # a pool with a zone keeps it
    on_demand = aws.launch(request(nodes=1, key="k-od", market=Market.ON_DEMAND))[0]
    assert on_demand.zone is not None  # one price everywhere: EC2 picks the AZ


def zone_names(region: str = "us-east-1") -> dict[str, str]:
    """The region's AZ ids -> the names this (moto) account launches with."""
    zones = session().client("ec2", region).describe_availability_zones()["AvailabilityZones"]
    return {z["ZoneId"]: z["ZoneName"] for z in zones}


def test_spot_launch_without_capacity_in_the_priced_az_names_it_and_tries_no_other(
        aws: AwsProvider) -> None:
    """p3.2xlarge spot in us-east-1: use1-az1 $0.5197, az6 $0.6827, az5 $0.7031, az2 $0.7657.
    One attempt tries one AZ; the next attempt (a new key) avoids the AZs that refused."""
    names = zone_names()
    cheapest, second = names["use1-az1"], names["use1-az6"]
    ec2 = aws._client("ec2", "us-east-1")
    sent = record_launches(ec2)
    ec2_refuses(ec2, "InsufficientInstanceCapacity", zone=cheapest)
    with pytest.raises(CapacityError, match=f"run_instances in {cheapest}") as refused:
        aws.launch(request(nodes=1))
    assert refused.value.zone == cheapest  # others remain: only that AZ is out
    assert sent == {cheapest: {bootstrap.token("job-1:7:0")}} and aws.nodes() == []
    # The next attempt names the refused AZ by name or by id, as the blocklist holds it.
    for key, avoid in (("job-1:8:0", (cheapest,)), ("job-1:9:0", ("use1-az1",))):
        (node,) = aws.launch(request(nodes=1, key=key, avoid_zones=avoid))
        assert (node.zone, node.price_per_gpu_hour) == (second, 0.6827)  # what it costs
        assert sent[second] >= {bootstrap.token(key)}
    assert list(sent) == [cheapest, second]


def test_a_retry_of_a_key_never_launches_a_second_instance(
        aws: AwsProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first launch's record was lost and the tag lookup misses its instance (eventually
    consistent): EC2's ``ClientToken``, the key's in every AZ, returns the first launch (M5: at
    its AZ's price); the same key sent to another AZ fails and starts nothing."""
    ec2_honours_client_tokens(monkeypatch)
    names = zone_names()
    req = request(nodes=1, avoid_zones=("use1-az1",))  # lands in use1-az6, $0.6827
    (first,) = aws.launch(req)
    found = aws._by_key
    missed: list[str] = []

    def lagging(region: str, key: str) -> list:
        if not missed:
            missed.append(key)
            return []  # DescribeInstances does not show the new instance yet
        return found(region, key)

    monkeypatch.setattr(aws, "_by_key", lagging)
    again = aws.launch(req)
    assert missed == [req.idempotency_key]
    assert [(n.node_id, n.zone, n.price_per_gpu_hour) for n in again] == \
        [(first.node_id, names["use1-az6"], 0.6827)]
    # Found by its tag this time: the same node, at the same price.
    assert [(n.node_id, n.price_per_gpu_hour) for n in aws.launch(req)] == \
        [(first.node_id, 0.6827)]
    # The zone refusals changed meanwhile and the listing lags again: the retry picks another
    # AZ under the same token, which EC2 refuses (IdempotentParameterMismatch, nothing
    # started); replayed in each priced AZ, the token's own AZ returns the first launch.
    missed.clear()
    moved = aws.launch(req.model_copy(update={"avoid_zones": ("use1-az1", "use1-az6")}))
    assert missed and [(n.node_id, n.price_per_gpu_hour) for n in moved] == \
        [(first.node_id, 0.6827)]
    assert [n.node_id for n in aws.nodes()] == [first.node_id]


def test_spot_launch_without_capacity_in_any_priced_az_is_a_capacity_error(
        aws: AwsProvider) -> None:
    names = zone_names()
    tried = [names[z] for z in ("use1-az1", "use1-az6", "use1-az5", "use1-az2")]
    ec2 = aws._client("ec2", "us-east-1")
    sent = record_launches(ec2)
    ec2_refuses(ec2, "InsufficientInstanceCapacity")
    for n, zone in enumerate(tried):  # one attempt per AZ, cheapest first
        with pytest.raises(CapacityError, match=f"run_instances in {zone}") as refused:
            aws.launch(request(nodes=1, key=f"job-1:7:{n}", avoid_zones=tuple(tried[:n])))
        assert refused.value.zone == (zone if n < 3 else None)  # the last: the pool is out
    assert list(sent) == tried
    with pytest.raises(CapacityError, match=r"every AZ with a p3\.2xlarge spot price") as refused:
        aws.launch(request(nodes=1, key="job-1:7:4", avoid_zones=tuple(tried)))
    assert refused.value.zone is None and list(sent) == tried  # not sent at all
    assert aws.nodes() == []


def test_a_pool_with_a_zone_and_quota_errors_do_not_fall_back(aws: AwsProvider) -> None:
    names = zone_names()
    ec2 = aws._client("ec2", "us-east-1")
    sent = record_launches(ec2)
    ec2_refuses(ec2, "InsufficientInstanceCapacity", zone=names["use1-az6"])
    with pytest.raises(CapacityError) as refused:
        aws.launch(request(nodes=1, zone="use1-az6"))  # the pool's zone, by id or name
    assert refused.value.zone is None  # the pool is that zone: the whole pool is out
    ec2_refuses(ec2, "MaxSpotInstanceCountExceeded", zone=names["use1-az1"])
    with pytest.raises(QuotaError):
        aws.launch(request(nodes=1, key="k-quota"))
    assert list(sent) == [names["use1-az6"], names["use1-az1"]]


def test_spot_interruption_warning_becomes_a_notice(aws: AwsProvider) -> None:
    ec2 = session().client("ec2", "us-east-1")
    resp = ec2.request_spot_instances(
        InstanceCount=1,
        LaunchSpecification={"ImageId": aws.image_id, "InstanceType": "p3.2xlarge"},
    )
    spot = resp["SpotInstanceRequests"][0]
    req = ec2.describe_spot_instance_requests(
        SpotInstanceRequestIds=[spot["SpotInstanceRequestId"]]
    )["SpotInstanceRequests"][0]
    tags = bootstrap.tags(request(nodes=1), "test-broker")
    ec2.create_tags(
        Resources=[req["InstanceId"]], Tags=[{"Key": k, "Value": v} for k, v in tags.items()]
    )
    assert aws.notices() == []
    # moto never interrupts: flip the request's status the way EC2 does two minutes before.
    backend = ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]
    backend.spot_instance_requests[
        spot["SpotInstanceRequestId"]
    ]._status_code = "marked-for-termination"
    notices = aws.notices()
    assert [n.node_id for n in notices] == [f"us-east-1/{req['InstanceId']}"]
    when = datetime(2015, 1, 1, tzinfo=UTC)  # moto's fixed UpdateTime
    assert notices[0].deadline == when + timedelta(minutes=2)


def test_against_a_moto_server_process_on_loopback() -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        aws = AwsProvider(
            ["us-east-1"], broker_id="srv", image_id=IMAGE, endpoint_url=url, session=session()
        )
        nodes = aws.launch(request(nodes=1))
        assert [n.node_id for n in aws.launch(request(nodes=1))] == [nodes[0].node_id]
        assert [n.node_id for n in aws.nodes()] == [nodes[0].node_id]
        aws.terminate(nodes[0].node_id)
        assert all(n.state is NodeState.TERMINATED for n in aws.nodes())
    finally:
        server.stop()
