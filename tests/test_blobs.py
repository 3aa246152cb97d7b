"""The blob store of packed workdirs and file mounts: each team's quota on what it keeps, uploads
streamed to disk, and the broker loop's sweep of the packs no active job needs."""

from __future__ import annotations

import gzip
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.api import build_app
from broker.files import BlobStore
from broker.models import JobState
from broker.server import BrokerConfig, build_broker
from broker.spec import parse_spec_text
from broker.store import Store
from tests.api_server import TOKENS, ApiServer, api_config
from tests.redis_server import RedisServer

SPEC = "name: files\nrun: python x.py\ngpus: 1\nbatch_size: 8\nwork: {samples: 80}\n"
# One GPU: the sweep's test job (two GPUs) waits in the queue, launching nothing.
FLEET = """
regions:
  - {cloud: aws, region: east, market: on-demand, price_per_gpu_hour: 1.0, gpus: 1}
"""


def pack(n: int) -> bytes:
    """A gzip stream of about ``n`` bytes (random data does not compress)."""
    return gzip.compress(os.urandom(n), compresslevel=0)


@pytest.fixture
def quota_server(store: Store, tmp_path: Path) -> Iterator[ApiServer]:
    """The API with packs kept under a 3,000-byte quota per team."""
    server = ApiServer(build_app(store, api_config(),
                                 blobs=BlobStore(tmp_path / "blobs", quota_bytes=3000))).start()
    yield server
    server.stop()


def upload(server: ApiServer, who: str, data: bytes | Iterator[bytes]) -> httpx.Response:
    return httpx.post(server.url + "/v1/blobs", content=data, timeout=10,
                      headers={"Authorization": f"Bearer {TOKENS[who]}"})


def test_a_team_over_its_quota_is_refused_413_naming_it(quota_server: ApiServer,
                                                         tmp_path: Path) -> None:
    first = pack(2000)
    r = upload(quota_server, "ml", first)
    assert r.status_code == 201 and r.json()["bytes"] == len(first)
    assert upload(quota_server, "ml", first).status_code == 201  # kept already: no new bytes
    second = pack(2000)
    for body in (second, iter([second[:1], second[1:1000], second[1000:]])):  # declared, chunked
        r = upload(quota_server, "ml", body)
        assert r.status_code == 413, r.text
        message = r.json()["error"]["message"]
        assert "team ml" in message and "3,000-byte quota (api.blob_quota_bytes)" in message
        assert "blob_retention_s" in message
    # nothing of the refused uploads is left behind; another team has its own quota
    assert [p.name for p in (tmp_path / "blobs" / "ml").iterdir()] == [
        r.removeprefix("blob:sha256:") + ".tar.gz"
        for r in [upload(quota_server, "ml", first).json()["ref"]]]
    assert upload(quota_server, "vision", second).status_code == 201
    r = upload(quota_server, "ml", iter([b"\x1f", b"not gzip"]))
    assert r.status_code == 422 and "gzip" in r.json()["error"]["message"]


def test_a_team_job_finds_its_own_and_the_admins_packs_not_another_teams(
        quota_server: ApiServer) -> None:
    mine = upload(quota_server, "ml", pack(100)).json()["ref"]
    admins = upload(quota_server, "admin", pack(100)).json()["ref"]
    theirs = upload(quota_server, "vision", pack(100)).json()["ref"]
    for ref, status in ((mine, 201), (admins, 201), (theirs, 422)):
        r = httpx.post(quota_server.url + "/v1/jobs", content=SPEC + f"workdir: {ref}\n",
                       headers={"Authorization": f"Bearer {TOKENS['ml']}",
                                "Content-Type": "application/yaml"}, timeout=10)
        assert r.status_code == status, r.text
    assert "upload it first" in r.json()["error"]["problems"][0]["message"]


def test_the_loop_deletes_old_packs_no_active_job_references(
        redis_server: RedisServer, store: Store, tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "state" / "blobs")

    def keep(owner: str, age_s: float) -> str:
        up = blobs.upload(owner)
        up.write(pack(50))
        ref = up.commit()
        path = blobs.path(ref.removeprefix("blob:sha256:"), owner)
        assert path is not None
        os.utime(path, (time.time() - age_s,) * 2)
        return ref

    queued, finished, young, old = (keep("ml", 7200), keep("ml", 7200), keep("ml", 60),
                                    keep("ml", 7200))
    waiting = SPEC.replace("gpus: 1", "gpus: 2") + f"workdir: {queued}\n"
    job = store.submit(parse_spec_text(waiting).spec, team="ml")
    done = store.submit(parse_spec_text(SPEC + f"workdir: {finished}\n").spec, team="ml")
    assert store.request_cancel(done.id).state is JobState.CANCELLED
    (tmp_path / "fleet.yaml").write_text(FLEET)
    broker = build_broker(BrokerConfig(state_dir=tmp_path / "state", fleet=tmp_path / "fleet.yaml",
                                       use_agent=False, blob_retention_s=3600),
                          redis_url=redis_server.url, blobs=blobs)
    broker.step()
    kept = {ref for ref in (queued, finished, young, old)
            if blobs.path(ref.removeprefix("blob:sha256:"), "ml") is not None}
    assert kept == {queued, young}
    assert store.get_job(job.id).state is JobState.QUEUED  # type: ignore[union-attr]
