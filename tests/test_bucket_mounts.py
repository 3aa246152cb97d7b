"""SkyPilot's named buckets in file_mounts (``{name, store, source, mode}``, issue 15): the
translation keeps SkyPilot's meaning and refusals; the broker puts the bucket on the placed
cloud's store when the task names none; the node makes the bucket if absent, fills it from a
local source and mounts or copies it (a moto S3 server on loopback, the runtime's own code)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from broker.actuator import ActuatorConfig, launch_request
from broker.models import Intent, IntentKind, JobRecord
from broker.runtime.agent import free_port
from broker.runtime.files import FilesError, files_of, place
from broker.spec import SpecError, parse_spec_text
from policies.models import Accelerator, Market, Pool


def _mount(entry: str, envs: str = "") -> dict[str, object]:
    parsed = parse_spec_text(f"run: x\nresources: {{accelerators: T4:1}}\n{envs}"
                             f"file_mounts:\n  /out: {entry}\n")
    (mount,) = parsed.spec.file_mounts
    return mount.model_dump(mode="json", exclude={"path"})


def _problem(entry: str) -> str:
    with pytest.raises(SpecError) as info:
        _mount(entry)
    (problem,) = info.value.problems
    return str(problem)


def test_a_named_bucket_mounts_by_default_as_skypilots_does() -> None:
    assert _mount("{name: my-out}") == {"source": None, "mode": "MOUNT", "name": "my-out",
                                        "store": None}
    assert _mount("{name: my-out, store: GCS, mode: MOUNT_CACHED}")["store"] == "gcs"
    assert _mount("{name: my-out, source: ./data, mode: COPY}") == {
        "source": "./data", "mode": "COPY", "name": "my-out", "store": None}
    # a storage mapping of a bucket mounts; a plain string is copied
    assert _mount("{source: s3://b/data}")["mode"] == "MOUNT"
    assert _mount("s3://b/data")["mode"] == "COPY"
    # the task's envs fill the name in ($X and ${X}), launch values first
    assert _mount("{name: $B}", envs="envs: {B: from-env}\n")["name"] == "from-env"
    assert _mount("{name: 'ckpt-${B}'}", envs="envs: {B: x1}\n")["name"] == "ckpt-x1"


@pytest.mark.parametrize(("entry", "says"), [
    ("{name: YOUR_BUCKET}", "file_mounts./out.name (got 'YOUR_BUCKET'): a bucket name is 3-63 "
                            "lowercase"),
    ("{name: my-out, mode: COPY}", "file_mounts./out.mode (got 'COPY'): a new bucket has "
                                   "nothing to copy: use mode: MOUNT"),
    ("{name: my-out, source: s3://b/x}", "file_mounts./out.name (got 'my-out'): s3://b/x names "
                                         "its bucket already: remove name"),
    ("{name: my-out, store: r2}", "file_mounts./out.store (got 'r2'): use one of s3, gcs, azure"),
    ("{source: s3://b, store: s3}", "file_mounts./out.store (got 's3'): store says where "
                                    "FleetBroker creates a bucket: give name too"),
    ("{mode: MOUNT}", "file_mounts./out.source: write a source"),
    ("{source: ./d, mode: MOUNT}", "file_mounts./out.mode (got 'MOUNT'): only a bucket (s3://, "
                                   "gs://, az://) can be mounted: use COPY, or give name"),
])
def test_skypilots_refusals_name_the_field_and_the_fix(entry: str, says: str) -> None:
    assert _problem(entry).startswith(says)


def test_an_unset_store_becomes_the_placed_clouds() -> None:
    spec = parse_spec_text("run: x\nresources: {accelerators: V100:1}\nfile_mounts:\n"
                           "  /out: {name: my-out}\n  /in: {name: mine, store: gcs}\n").spec
    job = JobRecord(id="t-1", spec=spec, team="ml")
    intent = Intent(kind=IntentKind.LAUNCH, job_id=job.id, fence=1, attempt=1, gpus=1,
                    batch_size=1, pool="p")
    stores = {}
    for cloud in ("aws", "gcp", "azure", "local"):
        pool = Pool(cloud=cloud, region="r1", accelerator=Accelerator.V100,
                    market=Market.ON_DEMAND, nodes=1, gpus_per_node=1, price_per_gpu_hour=1.0)
        files = files_of(launch_request(job, intent, pool, ActuatorConfig()).env)
        assert files is not None
        stores[cloud] = [m["store"] for m in files["mounts"]]
    # the store the task names wins; local nodes have none (the agent says to set one)
    assert stores == {"aws": ["s3", "gcs"], "gcp": ["gcs", "gcs"], "azure": ["azure", "gcs"],
                      "local": [None, "gcs"]}


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[boto3.client]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    host, port = server.get_host_and_port()
    # boto3's usual settings, as a node's environment carries them
    for k, v in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}.items():
        monkeypatch.setenv(k, v)
    yield boto3.client("s3")
    server.stop()


def _pack(files: dict[str, str]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return out.getvalue()


def test_the_node_creates_fills_and_copies_a_named_bucket(s3: boto3.client,
                                                          tmp_path: Path) -> None:
    packs = {"ab" * 32: _pack({"cfg.yaml": "lr: 1\n", "sub/w.txt": "W\n"})}
    files = {"mounts": [{"path": "results", "source": "blob:sha256:" + "ab" * 32,
                         "mode": "COPY", "name": "fresh-out", "store": "s3"}]}
    place(files, tmp_path, packs.__getitem__)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="fresh-out")["Contents"]]
    assert keys == ["cfg.yaml", "sub/w.txt"]
    # copied down from the bucket; the relative destination under the workdir
    placed = tmp_path / "sky_workdir" / "results"
    assert (placed / "sub" / "w.txt").read_text() == "W\n"
    # launched again (a move): the bucket this account owns is reused, with what the job wrote
    s3.put_object(Bucket="fresh-out", Key="ckpt.pt", Body=b"step 9")
    place(files, tmp_path / "again", packs.__getitem__)
    assert (tmp_path / "again" / "sky_workdir" / "results" / "ckpt.pt").read_bytes() == b"step 9"


def test_a_mount_of_a_named_bucket_needs_its_fuse_tool(s3: boto3.client, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # a node without goofys
    files = {"mounts": [{"path": "/mnt/never-made", "source": None, "mode": "MOUNT",
                         "name": "scratch-out", "store": "s3"}]}
    with pytest.raises(FilesError, match=r"needs goofys on the node.*or use mode: COPY"):
        place(files, tmp_path, {}.__getitem__)
    assert s3.head_bucket(Bucket="scratch-out")  # made before the mount was tried
    assert not Path("/mnt/never-made").exists()


def test_a_named_bucket_without_a_store_says_to_set_one(tmp_path: Path) -> None:
    files = {"mounts": [{"path": "/o", "source": None, "mode": "MOUNT", "name": "my-out",
                         "store": None}]}
    with pytest.raises(FilesError, match=r"bucket my-out names no store.*set store: s3, gcs"):
        place(files, tmp_path, {}.__getitem__)

