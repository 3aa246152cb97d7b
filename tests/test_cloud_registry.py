"""The cloud registry is the one list of clouds: no other module enumerates them, and a new cloud
is its own folder (a ``Cloud`` subclass) plus one line in ``providers.registry.HOMES``."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from broker.spec import SpecError, parse_spec_text
from policies.models import STORE_SCHEMES, Accelerator, Market
from providers import bootstrap, catalog, registry
from providers.base import LaunchRequest, NotConfiguredError
from providers.fleet import FleetFile

ROOT = Path(__file__).resolve().parents[1]
# The code that must learn the clouds from the registry (tests may name clouds as data).
CODE = ("broker", "policies", "providers", "docs/hooks", "tests/bench", "examples")

SPEC = """
name: digits
run: python train.py
batch_size: {min: 32, max: 256}
work: {samples: 6400}
"""


def _listed(node: ast.AST) -> list[str]:
    """The string constants a literal tuple, list or set holds, or a dict literal's keys."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None]
    else:
        return []
    return [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]


def test_no_module_but_the_registry_lists_the_clouds() -> None:
    clouds = set(registry.names())
    found = []
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                named = clouds & set(_listed(node))
                if len(named) >= 2:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(named)}")
    assert found == [], "enumerate clouds through providers.registry instead:\n" + "\n".join(found)


def test_every_cloud_lives_in_its_own_folder() -> None:
    for home, (name, cloud) in zip(registry.HOMES, registry.clouds().items(), strict=True):
        assert home == f"providers.{name}" and (ROOT / "providers" / name / "__init__.py").exists()
        assert cloud.region_problem(cloud.region_example) is None
        assert cloud.object_store in (None, *STORE_SCHEMES)  # a store a task's bucket may name


ACME = '''
"""A made-up cloud: everything the broker needs to know about it, in its own folder."""

import re

from providers.base import NotConfiguredError
from providers.catalog import read_vms_csv
from providers.cloud import Cloud

ROWS = (
    "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,"
    "Region,AvailabilityZone\\nacme.gpu4,T4,4,16,64,,4.00,1.20,acme-1,\\n"
)


class Acme(Cloud):
    name = "acme"
    aliases = ("acmecorp",)
    region_shape = re.compile(r"^acme-[0-9]+$")
    region_example = "acme-1"
    notice = ("FLEET_NOTICE_ACME_URL", "http://127.0.0.1:9/acme/preempted")
    not_configured = "acme is not configured: set ACME_TOKEN"
    capacity_codes = frozenset({"NoRoom"})

    def error_codes(self, exc):
        code = getattr(exc, "code", None)
        return None if code is None else ({code}, str(exc))

    def snapshot(self):
        return read_vms_csv(ROWS, self.name, "acme rows")

    def provider(self, **options):
        raise NotConfiguredError(self.not_configured)


CLOUD = Acme()
'''


@pytest.fixture
def acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The made-up cloud's folder, and its one line in the registry."""
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "__init__.py").write_text(textwrap.dedent(ACME))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "HOMES", (*registry.HOMES, "acme"))
    monkeypatch.setenv("FLEET_CONFIG_DIR", str(tmp_path / "config"))


@pytest.mark.usefixtures("acme")
def test_a_new_cloud_is_its_folder_and_one_registry_line(tmp_path: Path) -> None:
    assert registry.names()[-1] == "acme" and "acme" in registry.priced()
    assert registry.meant("acmecorp") == "acme" and registry.meant("acne") == "acme"

    # job specs: its regions are allowed, and a wrong one is explained with its example
    assert parse_spec_text(SPEC + "regions: [acme:acme-7]").spec.regions.allow == ["acme:acme-7"]
    for text, fix in (("checkpoint: {region: 'acme:us-east-1'}", "write one like acme:acme-1"),
                      ("regions: [acme-3]", "did you mean acme:acme-3?"),
                      ("regions: [acmecorp:acme-1]", "did you mean 'acme:acme-1'?")):
        with pytest.raises(SpecError) as info:
            parse_spec_text(SPEC + text)
        assert fix in str(info.value), text

    # its price catalog
    (offer,) = catalog.load_offers(["acme"])
    assert (offer.instance_type, offer.accelerator, offer.spot_price) == (
        "acme.gpu4", Accelerator.T4, 1.2)

    # the agent on its spot VMs polls its notice URL
    request = LaunchRequest(idempotency_key="k", job_id="j", cloud="acme", region="acme-1",
                            accelerator=Accelerator.T4, gpus_per_node=4, market=Market.SPOT)
    env = bootstrap.agent_env(request, "acme")
    assert env["FLEET_NOTICE_ACME_URL"] == "http://127.0.0.1:9/acme/preempted"

    # its error mapping is the base class's one pattern
    err = type("AcmeError", (Exception,), {"code": "NoRoom"})("out of T4")
    assert type(registry.get("acme").map_error(err, "launch")).__name__ == "CapacityError"

    # a fleet file may declare it, and an unconfigured one is skipped with its fix
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("clouds: {acme: {regions: [acme-1]}}\n")
    assert list(FleetFile.load(fleet).clouds) == ["acme"]
    built, skipped = registry.build_providers(["acme"])
    assert built == {} and skipped == {"acme": "acme is not configured: set ACME_TOKEN"}
    with pytest.raises(NotConfiguredError, match="set ACME_TOKEN"):
        registry.get("acme").provider()
