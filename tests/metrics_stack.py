"""A running broker for the metrics tests: a real redis-server, the leader loop over the local
provider (three pretend regions, two spot) and the API on loopback, with a metrics token; and
a scrape of ``/metrics`` parsed with prometheus_client's own parser."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from broker.api import build_app
from broker.auth import Role
from broker.server import Broker, BrokerConfig, build_broker
from tests.api_server import TOKENS, ApiServer, api_config
from tests.redis_server import RedisServer

METRICS_TOKEN = "metrics-token-0123456789"
FLEET = """
grace_period_s: 2
regions:
  - {cloud: aws, region: east, market: spot, price_per_gpu_hour: 0.3, gpus: 2}
  - {cloud: gcp, region: west, market: spot, price_per_gpu_hour: 0.4, gpus: 2}
  - {cloud: azure, region: south, market: on-demand, price_per_gpu_hour: 1.0, gpus: 2}
"""


@dataclass
class Running:
    broker: Broker
    api: ApiServer
    redis: RedisServer

    def scrape(self, token: str = METRICS_TOKEN) -> Scrape:
        r = httpx.get(f"{self.api.url}/metrics", headers={"Authorization": f"Bearer {token}"},
                      timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        return Scrape(r.text)


class Scrape:
    """One scrape: its families (by name, as the parser names them) and samples."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def samples(self, name: str, **labels: str) -> list[Sample]:
        return [s for f in self.families.values() for s in f.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        return sum(s.value for s in self.samples(name, **labels))

    def exposed(self) -> set[str]:
        """Every series name a query may use: each sample's, and each family's with the suffixes
        its type gives (a family without samples yet, e.g. a labelled counter never
        incremented, is still exposed by name)."""
        names = {s.name for f in self.families.values() for s in f.samples}
        for f in self.families.values():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"),
                        "summary": ("_count", "_sum")}.get(f.type, ("",))
            names |= {f.name + s for s in suffixes}
        return names


@contextmanager
def running_broker(tmp: Path) -> Iterator[Running]:
    """Everything started, and stopped again on exit (nodes terminated, servers stopped)."""
    redis = RedisServer(tmp / "redis")
    redis.start()
    fleet = tmp / "fleet.yaml"
    fleet.write_text(FLEET)
    config = BrokerConfig(state_dir=tmp / "state", fleet=fleet, tick_s=0.2, lease_ttl_s=3,
                          use_agent=False)
    broker = api = None
    try:
        broker = build_broker(config, redis_url=redis.url)
        api = ApiServer(build_app(broker.store, api_config().with_token(
            METRICS_TOKEN, Role.METRICS))).start()
        broker.start()
        yield Running(broker, api, redis)
    finally:
        if broker is not None:
            broker.stop()
            for n in broker.provider.nodes():
                broker.provider.terminate(n.node_id)
        if api is not None:
            api.stop()
        redis.stop()


def wait_for(cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


ADMIN = TOKENS["admin"]
