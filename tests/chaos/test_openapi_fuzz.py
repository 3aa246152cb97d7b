"""Schemathesis against the API's own ``/openapi.json`` (in-process ASGI over a real
redis-server): every operation, fuzzed with valid and invalid input, answers no 5xx, and every
answer's status, content type and body conform to what the OpenAPI declares."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.strategies import SearchStrategy
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from broker.api import build_app
from broker.store import Store
from policies.models import Accelerator, JobSpec, Market, Pool
from tests.api_server import TOKENS, api_config
from tests.chaos.conftest import Tally
from tests.redis_server import RedisServer

# Cases per generation mode, across every operation: `make test` (about 10 s a mode on 2
# cores) and `make chaos`.
MAX_EXAMPLES = 300
LONG_EXAMPLES = 5000
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    redis = RedisServer(tmp_path_factory.mktemp("fuzz") / "redis")
    redis.start()
    try:
        store = Store.from_url(redis.url)
        store.set_pools([Pool(cloud="local", region="east", accelerator=Accelerator.T4,
                              market=Market.SPOT, nodes=1, gpus_per_node=4,
                              price_per_gpu_hour=0.2)])
        store.submit(JobSpec(name="seed", run="echo hi", batch_size={"min": 1, "max": 1},
                             work_samples=1), team="ml")
        store.acquire_lease("fuzz-leader", 3600)  # a leader is known: /readyz answers 200
        yield schemathesis.openapi.from_asgi("/openapi.json", build_app(store, api_config()))
    finally:
        redis.stop()


@pytest.mark.parametrize("examples", [
    MAX_EXAMPLES, pytest.param(LONG_EXAMPLES, marks=pytest.mark.chaos, id="long")])
@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
def test_no_5xx_and_every_answer_as_declared(api_schema: schemathesis.BaseSchema,
                                             mode: GenerationMode, examples: int,
                                             chaos: Tally) -> None:
    """Cases drawn across all operations: ``positive`` fits the schema, ``negative`` breaks it
    (schemathesis' pytest loader for fixtures does not run on pytest 9; its strategies do)."""

    answered: dict[str, set[int]] = {}
    errors = [0]

    def fuzz(strategy: SearchStrategy[schemathesis.Case], n: int) -> None:
        @given(case=strategy)
        @settings(max_examples=n, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def one(case: schemathesis.Case) -> None:
            r = case.call_and_validate(headers={"Authorization": f"Bearer {TOKENS['admin']}"},
                                       checks=CHECKS)
            answered.setdefault(case.operation.label, set()).add(r.status_code)
            errors[0] += r.status_code >= 500
            chaos.record(faults=mode is GenerationMode.NEGATIVE)

        one()

    # every operation is tried: a negative case needs a parameter or body to break, and may
    # break the declared bearer scheme of an operation that has neither
    ops = {f"{method.upper()} {path}": (path, method, op)
           for path, methods in api_schema.raw_schema["paths"].items()
           for method, op in methods.items()}
    needed = {label for label, (_, _, op) in ops.items()
              if mode is GenerationMode.POSITIVE or "requestBody" in op
              or any(p["in"] in ("path", "query") for p in op.get("parameters", []))}
    fuzz(api_schema.as_strategy(mode), examples)
    # a draw across all operations may miss one (the random mix): that one alone, briefly
    for label in sorted(needed - set(answered)):
        path, method, _ = ops[label]
        fuzz(api_schema[path][method].as_strategy(mode), 25)
    chaos.record(server_errors=errors[0])
    print(f"schemathesis {mode}: " + "; ".join(f"{op} {sorted(st)}"
                                               for op, st in sorted(answered.items())))
    assert needed <= set(answered) <= needed | {label for label, (_, _, op) in ops.items()
                                                if op.get("security")}
    assert all(s < 500 for st in answered.values() for s in st)


def test_the_openapi_declares_an_error_body_for_every_4xx(
        api_schema: schemathesis.BaseSchema) -> None:
    """Each operation names its error statuses with the one error body, not FastAPI's default
    ``HTTPValidationError`` (which the API never sends)."""
    doc = api_schema.raw_schema
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if path in ("/healthz", "/readyz"):  # probes: no token
                continue
            errors = {s: r for s, r in op["responses"].items() if s.startswith(("4", "5"))}
            assert {"401", "403", "503"} <= set(errors), (method, path)
            for status, r in errors.items():
                ref = r["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorBody"), (method, path, status)
