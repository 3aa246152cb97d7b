"""One error hierarchy: each class's HTTP status and CLI exit code, through the real API and CLI."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from broker import errors
from broker.auth import ConfigError
from broker.cli import app
from broker.client import BrokerUnreachable
from broker.models import IllegalTransition, JobState
from broker.runtime.assignment import AssignmentError
from broker.sim.engine import SimConfig, SimulationError
from broker.spec import SpecError
from broker.store import Conflict, JobNotFound, NotDurable, StaleFence, Store
from policies.elastic_dp import InfeasibleAllocation
from policies.models import Accelerator, SpecFieldError, UnknownAccelerator
from providers import registry
from providers.base import CapacityError, NotConfiguredError, ProviderError, QuotaError
from providers.catalog import load_offers, read_vms_csv
from providers.fleet import FleetFile
from tests.api_server import TOKENS, ApiServer, api_stack

ROOT = Path(__file__).resolve().parents[1]

# class -> (HTTP status, CLI exit code): the table docs and clients rely on
TABLE: dict[type[BaseException], tuple[int, int]] = {
    errors.FleetError: (500, 1),
    errors.InvalidInput: (422, 2),
    errors.PayloadTooLarge: (413, 2),
    errors.UnsupportedMedia: (415, 2),
    errors.NotFound: (404, 3),
    errors.Unauthenticated: (401, 4),
    errors.Forbidden: (403, 4),
    errors.Unavailable: (503, 5),
    errors.Conflict: (409, 6),
    errors.ProviderFailure: (502, 7),
    SpecError: (422, 2),
    ConfigError: (422, 2),
    AssignmentError: (422, 2),
    InfeasibleAllocation: (422, 2),  # policies' own, mapped
    UnknownAccelerator: (422, 2),  # policies' own, mapped
    SpecFieldError: (422, 2),  # policies' own, mapped
    SimulationError: (422, 2),
    JobNotFound: (404, 3),
    Conflict: (409, 6),
    StaleFence: (409, 6),
    IllegalTransition: (409, 6),
    NotDurable: (503, 5),
    BrokerUnreachable: (503, 5),
    ProviderError: (502, 7),
    CapacityError: (502, 7),
    QuotaError: (502, 7),
    NotConfiguredError: (502, 7),
}


def _instance(cls: type[BaseException]) -> BaseException:
    if cls is SpecError:
        return SpecError([])
    if cls is JobNotFound:
        return JobNotFound("j-1")
    if cls is NotDurable:
        return NotDurable("no fsync")
    if cls is InfeasibleAllocation:
        return InfeasibleAllocation(["j-1"], 4, 8)
    if cls is SpecFieldError:
        return SpecFieldError("gpus", "x")
    return cls("x")


@pytest.mark.parametrize("cls", list(TABLE), ids=lambda c: c.__name__)
def test_each_class_has_its_status_and_exit_code(cls: type[BaseException]) -> None:
    exc = _instance(cls)
    assert (errors.status_of(exc), errors.exit_code_of(exc)) == TABLE[cls]
    assert isinstance(errors.as_fleet_error(exc), errors.FleetError)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 413, 415, 422, 429, 500, 503])
def test_the_client_reads_an_answer_back_as_its_class(status: int) -> None:
    cls = errors.for_status(status)
    assert cls.status == status or (status, cls) in ((400, errors.InvalidInput),
                                                     (429, errors.InvalidInput),
                                                     (500, errors.Unavailable))


def _exception_classes() -> Iterator[tuple[str, str]]:
    """(module, class) of every exception class the three packages define."""
    for package in ("broker", "providers", "policies"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and any(
                        isinstance(b, ast.Name | ast.Attribute) and
                        ast.unparse(b).split(".")[-1].endswith(
                            ("Error", "Exception", "NotFound", "Conflict", "Unavailable",
                             "Input", "Failure", "Forbidden", "Unauthenticated", "Large",
                             "Media", "Fence", "Durable"))
                        for b in node.bases):
                    yield module, node.name


def test_every_error_class_is_rooted_or_mapped() -> None:
    found = list(_exception_classes())
    assert len(found) > 20
    loose = []
    for module, name in found:
        cls = getattr(importlib.import_module(module), name)
        if not issubclass(cls, errors.handled()) and not name.startswith("_"):
            loose.append(f"{module}.{name}")
    assert loose == []


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ApiServer, Store]]:
    with api_stack(tmp_path_factory.mktemp("errors")) as got:
        yield got


def _queued_job(store: Store) -> str:
    spec = (ROOT / "examples" / "jobs" / "digits-elastic.yaml").read_text()
    from broker.spec import parse_spec_text

    job = store.submit(parse_spec_text(spec).spec, team="ml")
    assert job.state is JobState.QUEUED
    return job.id


def test_the_api_answers_each_class_with_its_status(stack: tuple[ApiServer, Store]) -> None:
    srv, store = stack
    job_id = _queued_job(store)
    admin = {"Authorization": f"Bearer {TOKENS['admin']}"}
    team = {"Authorization": f"Bearer {TOKENS['ml']}"}
    cases = [
        (errors.NotFound, "GET", "/v1/jobs/nope-1", team, None),
        (errors.Unauthenticated, "GET", "/v1/jobs", {"Authorization": "Bearer wrong-0000"}, None),
        (errors.Forbidden, "POST", "/v1/chaos/preempt", team, {"region": "east"}),
        (errors.Conflict, "POST", "/v1/chaos/node", admin, {"job_id": job_id, "rank": 0}),
        (errors.InvalidInput, "POST", "/v1/jobs", team, {"name": "../x", "run": "true"}),
        (errors.UnsupportedMedia, "POST", "/v1/jobs",
         {**team, "Content-Type": "image/png"}, None),
        (errors.PayloadTooLarge, "POST", "/v1/jobs", team, {"run": "x" * 70_000}),
    ]
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for cls, method, path, headers, body in cases:
            r = c.request(method, path, headers=headers, json=body) if body is not None or \
                "Content-Type" not in headers else c.request(method, path, headers=headers,
                                                             content=b"\x89PNG")
            assert r.status_code == cls.status, (cls, r.text)
            err = r.json()["error"]
            assert err["status"] == cls.status and err["message"], err
        bad = c.post("/v1/jobs", headers=team, json={"name": "../x", "run": "true"}).json()
        assert bad["error"]["message"] == "invalid job spec"
        assert "name" in [p["field"] for p in bad["error"]["problems"]]


def test_the_cli_exits_with_each_class_exit_code(stack: tuple[ApiServer, Store],
                                                 tmp_path: Path) -> None:
    srv, store = stack
    job_id = _queued_job(store)
    env = {"FLEET_URL": srv.url, "FLEET_TOKEN": TOKENS["ml"],
           "FLEET_CONFIG": str(tmp_path / "config.yaml")}
    admin = {**env, "FLEET_TOKEN": TOKENS["admin"]}
    bad_spec = tmp_path / "bad.yaml"
    bad_spec.write_text("name: ../x\nrun: true\n")
    cases = [
        (errors.NotFound, env, ["job", "nope-1"], "no job 'nope-1'"),
        (errors.Unauthenticated, {**env, "FLEET_TOKEN": "wrong-token-0000"}, ["jobs"],
         "invalid token"),
        (errors.Forbidden, env, ["chaos", "preempt", "east"], "admin"),
        (errors.Conflict, admin, ["chaos", "node", job_id, "--rank", "0"], "is queued"),
        (errors.InvalidInput, env, ["launch", str(bad_spec)], "name (got '../x')"),
        (errors.Unavailable, {**env, "FLEET_URL": "http://127.0.0.1:9"}, ["jobs"], "fleet up"),
    ]
    for cls, where, args, said in cases:
        result = CliRunner().invoke(app, args, env=where)
        assert (result.exit_code, cls.exit_code) == (cls.exit_code, cls.exit_code), \
            (cls, result.stderr)
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr


# --- what crosses a module boundary is a FleetError (or one broker.errors maps) -----------------


def _bad_fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text("regions:\n  - region: east\n    price_per_gpu_hour: -1\n    gpus: 2\n")
    return path


@pytest.mark.parametrize(("refuse", "cls", "said"), [
    (lambda tmp: FleetFile.load(_bad_fleet(tmp)), errors.InvalidInput,
     "regions.0.price_per_gpu_hour"),
    (lambda tmp: FleetFile.load(tmp / "absent.yaml"), errors.InvalidInput,
     "cannot read fleet file"),
    (lambda tmp: registry.get("ibm"), errors.InvalidInput, "unknown cloud 'ibm'; use one of"),
    (lambda tmp: registry.build_providers(["gpc"]), errors.InvalidInput,
     "did you mean 'gcp'"),
    (lambda tmp: registry.build_providers(["aws"], launchers={"aws": "terraform"}),
     errors.InvalidInput, "unknown launcher 'terraform' for aws"),
    (lambda tmp: load_offers(["local"]), errors.InvalidInput, "has no price catalog"),
    (lambda tmp: read_vms_csv("a,b\n1,2\n", "aws"), errors.InvalidInput, "missing column"),
    (lambda tmp: Accelerator.parse("TPU"), UnknownAccelerator, "unknown accelerator 'TPU'"),
    (lambda tmp: SimConfig(interval=0), SimulationError, "interval must be positive"),
], ids=["fleet-field", "fleet-unreadable", "cloud", "cloud-to-rent", "launcher",
        "unpriced-cloud", "catalog-file", "accelerator", "sim-setting"])
def test_refusals_across_modules_are_fleet_errors(refuse, cls: type[Exception], said: str,
                                                  tmp_path: Path) -> None:
    with pytest.raises(cls, match=said) as got:
        refuse(tmp_path)
    assert errors.exit_code_of(got.value) == errors.InvalidInput.exit_code
    assert errors.status_of(got.value) == errors.InvalidInput.status


def test_the_cli_names_a_bad_fleet_file_with_its_exit_code(tmp_path: Path) -> None:
    fleet = _bad_fleet(tmp_path)
    p = subprocess.run([sys.executable, "-m", "broker", "up", "--fleet", str(fleet),
                        "--state-dir", str(tmp_path / "state")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "FLEET_CONFIG_DIR": str(tmp_path)})
    assert p.returncode == errors.InvalidInput.exit_code, p.stderr
    assert f"{fleet}: regions.0.price_per_gpu_hour" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "state").exists()


# Where a bare ``raise ValueError`` may stay in broker/ and providers/: inside pydantic
# validators (pydantic makes it a ValidationError), or these functions, each for its reason.
VALUE_ERROR_KEPT = {
    "broker/api.py:_stream_id": "an AfterValidator of a query parameter",
    "broker/spec.py:_json_object": "caught in broker.spec, which names the field",
    "broker/sim/baselines.py:__init__": "internal contract: the CLI checks the fleet first",
    "providers/bootstrap.py:node_rank": "internal contract between providers",
    "providers/bootstrap.py:rank_step": "internal contract between providers",
    "providers/skypilot.py:validate_task": "our own task against SkyPilot's schema: a bug",
}
# The job-side runtime is a library for training scripts: plain ValueError for bad arguments.
VALUE_ERROR_FREE = ("broker", "providers")
VALUE_ERROR_EXEMPT = ("broker/runtime/",)


def _value_error_raises() -> Iterator[str]:
    """``path:function`` of each ``raise ValueError`` outside a pydantic validator."""
    for package in VALUE_ERROR_FREE:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith(VALUE_ERROR_EXEMPT):
                continue
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or any(
                        "validator" in ast.unparse(d) for d in fn.decorator_list):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Raise) and node.exc is not None and \
                            ast.unparse(node.exc).split("(")[0] == "ValueError":
                        yield f"{rel}:{fn.name}"


def test_no_bare_value_error_leaves_a_module() -> None:
    found = set(_value_error_raises())
    assert found - set(VALUE_ERROR_KEPT) == set(), "raise an InvalidInput (broker.errors) instead"
    assert set(VALUE_ERROR_KEPT) <= found, "a kept ValueError is gone: drop its entry"
