"""SkyPilot fields with no meaning here are accepted with a note kept on the job; accelerators
are never read as another; CPU-only tasks become CPU jobs, never given a GPU (issue 15). The
notes travel through the real CLI and API (uvicorn on loopback, redis-server)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from broker.cli import app
from broker.runtime.files import node_path
from broker.spec import SpecError, parse_spec_text
from policies.models import Accelerator
from tests.api_server import TOKENS, api_stack


def _problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec_text(text)
    return [str(p) for p in info.value.problems]


@pytest.mark.parametrize(("key", "value", "note"), [
    ("autostop", "10m", "releases a job's nodes"),
    ("network_tier", "best", "network"),
    ("disk_tier", "high", "disk"),
    ("ports", 8080, "not opened"),
    ("image_id", "ami-0123456789abcdef0", "fleet's own image"),
])
def test_meaningless_resource_fields_are_accepted_with_a_note(key: str, value: object,
                                                              note: str) -> None:
    parsed = parse_spec_text(f"run: x\nresources: {{accelerators: T4:1, {key}: {value}}}")
    assert parsed.spec.accelerators == [Accelerator.T4]
    assert [w for w in parsed.warnings if w.startswith(f"resources.{key}:") and note in w]


def test_a_container_image_becomes_the_jobs_container() -> None:
    parsed = parse_spec_text("run: x\nresources: {accelerators: T4, image_id: "
                             "'docker:nvcr.io/nvidia/pytorch:24.01-py3'}")
    assert parsed.spec.container_image == "nvcr.io/nvidia/pytorch:24.01-py3"
    assert parsed.spec.run_per_node and not [w for w in parsed.warnings if "image_id" in w]
    # the canonical JSON keeps it, and stays the project's own format
    again = parse_spec_text(parsed.spec.model_dump_json())
    assert again.spec == parsed.spec


def test_any_of_alternatives_share_one_container_image() -> None:
    same = parse_spec_text("run: x\nresources:\n  image_id: docker:repo/img:1\n  any_of:\n"
                           "    - {accelerators: T4:1}\n    - {accelerators: V100:1}\n")
    assert same.spec.container_image == "repo/img:1"
    found = _problems("run: x\nresources:\n  any_of:\n"
                      "    - {accelerators: T4:1, image_id: 'docker:repo/a'}\n"
                      "    - {accelerators: V100:1}\n")
    assert any(p.startswith("resources.any_of[0].image_id") and "same image_id" in p
               for p in found), found


@pytest.mark.parametrize("image", ["repo/x; rm -rf /", "repo/x $(id)", "Repo/Upper", "-rm",
                                   "repo/x:`id`", "repo'x", ""])
def test_an_image_that_is_no_image_reference_is_refused(image: str) -> None:
    found = _problems(f"run: x\nresources: {{accelerators: T4, image_id: \"docker:{image}\"}}")
    assert any(p.startswith("resources.image_id") and "container image reference" in p
               for p in found), found
    with pytest.raises(SpecError):  # the own format checks it the same way
        parse_spec_text(json.dumps({"name": "a", "run": "x", "batch_size": 1, "work_samples": 1,
                                    "run_per_node": True, "container_image": image}))


def test_any_of_drops_alternatives_on_clouds_it_does_not_have() -> None:
    parsed = parse_spec_text(
        "run: x\nresources:\n  any_of:\n"
        "    - {infra: k8s, accelerators: H100:8}\n"
        "    - {cloud: lambda, accelerators: H100:8}\n"
        "    - {infra: gcp/us-central1, accelerators: A100:8}\n")
    assert parsed.spec.accelerators == [Accelerator.A100]
    assert parsed.spec.regions.allow == ["gcp:us-central1"]
    dropped = [w for w in parsed.warnings if "dropped" in w]
    assert len(dropped) == 2 and "'k8s'" in dropped[0] and "'lambda'" in dropped[1]


def test_any_of_with_no_supported_cloud_is_refused() -> None:
    found = _problems("run: x\nresources:\n  any_of:\n    - {infra: k8s}\n"
                      "    - {cloud: runpod}\n")
    assert any(p.startswith("resources.any_of") and "aws, gcp, azure, local" in p
               for p in found), found


@pytest.mark.parametrize(("value", "hint"), [("A100X", "did you mean A100?"),
                                            ("H1000", "did you mean H100?"),
                                            ("TPU-v4", "use one of")])
def test_an_unknown_accelerator_gets_a_did_you_mean(value: str, hint: str) -> None:
    for text in (f"run: x\nresources: {{accelerators: {value}:8}}",
                 f"name: j\nrun: x\naccelerators: [{value}]\nbatch_size: 8\n"
                 "work: {samples: 8}"):
        found = _problems(text)
        assert any("unknown accelerator" in p and hint in p and value in p for p in found), \
            found


def test_accelerator_variants_still_read_as_their_type() -> None:
    for name, want in (("A100-80GB-SXM4", Accelerator.A100), ("H100-PCIe", Accelerator.H100),
                       ("V100-32GB", Accelerator.V100), ("A10G", Accelerator.A10G)):
        assert Accelerator.parse(name) is want


@pytest.mark.parametrize(("resources", "cpus", "memory"), [
    ("{cpus: 4+}", "4+", None), ("{cpus: 8, memory: 32+}", "8", "32+"),
    ("{any_of: [{cpus: 4+, infra: aws}]}", "4+", None), ("{cpus: 0.5}", "0.5", None)])
def test_a_cpu_only_task_becomes_a_cpu_job_never_a_gpu(resources: str, cpus: str,
                                                       memory: str | None) -> None:
    parsed = parse_spec_text(f"run: x\nnum_nodes: 2\nresources: {resources}")
    spec = parsed.spec
    assert spec.cpu_only and spec.accelerators == [Accelerator.CPU]
    assert (spec.cpus, spec.memory, spec.nodes, spec.run_per_node) == (cpus, memory, 2, True)
    assert not any("cpus" in w or "memory" in w for w in parsed.warnings), parsed.warnings


@pytest.mark.parametrize("text", ["run: echo hi",
                                  "run: x\nresources: {infra: azure, disk_size: 512}"])
def test_a_task_without_accelerators_runs_on_cpu_nodes_not_a_default_gpu(text: str) -> None:
    """SkyPilot's meaning of no accelerators: a CPU task, not the default T4."""
    parsed = parse_spec_text(text)
    assert parsed.spec.accelerators == [Accelerator.CPU] and parsed.spec.cpus is None


@pytest.mark.parametrize(("resources", "field", "fix"), [
    ("{cpus: many}", "resources.cpus", "like 4 (exactly 4) or 4+"),
    ("{memory: -2}", "resources.memory", "like 4 (exactly 4) or 4+"),
    ("{any_of: [{cpus: 2}, {cpus: 4}]}", "resources.any_of.cpus", "give one cpus")])
def test_a_bad_cpu_size_names_the_field_and_the_fix(resources: str, field: str,
                                                    fix: str) -> None:
    found = _problems(f"run: x\nresources: {resources}")
    assert any(p.startswith(field) and fix in p for p in found), found


def test_unknown_keys_get_a_did_you_mean() -> None:
    found = _problems("run: x\nnum_node: 2\nresources: {use_spott: true}")
    assert any(p.startswith("num_node") and "did you mean 'num_nodes'" in p for p in found)
    assert any(p.startswith("resources.use_spott") and "did you mean 'use_spot'" in p
               for p in found), found


def test_notes_are_kept_on_the_job_and_shown(tmp_path: Path) -> None:
    task = tmp_path / "task.yaml"
    task.write_text("name: noted\nrun: echo hi\nresources: {accelerators: T4:1, "
                    "autostop: 10m, ports: 8888}\n")
    with api_stack(tmp_path / "stack") as (srv, store):
        env = {"FLEET_URL": srv.url, "FLEET_TOKEN": TOKENS["ml"],
               "FLEET_CONFIG": str(tmp_path / "client.yaml")}
        runner = CliRunner()
        got = runner.invoke(app, ["launch", str(task), "--json"], env=env)
        assert got.exit_code == 0, got.stderr
        job = json.loads(got.stdout)
        assert [n.split(":")[0] for n in job["notes"]] == ["resources.autostop",
                                                           "resources.ports"]
        stored = store.get_job(job["id"])
        assert stored is not None and stored.notes == job["notes"]
        got = runner.invoke(app, ["job", job["id"]], env=env)
        assert got.exit_code == 0 and "note: resources.autostop: ignored" in got.stdout
        # a task posted to the API as YAML: the API's own translation notes it
        headers = {"Authorization": f"Bearer {TOKENS['ml']}",
                   "Content-Type": "application/yaml"}
        r = httpx.post(f"{srv.url}/v1/jobs", content=task.read_text(), headers=headers)
        assert r.status_code == 201 and r.json()["job"]["notes"] == job["notes"]
        r = httpx.post(f"{srv.url}/v1/jobs", params={"note": "x" * 301},
                       content=task.read_text(), headers=headers)
        assert r.status_code == 422 and "note" in r.text


def test_the_legacy_candidates_key_points_to_any_of() -> None:
    (found,) = _problems("run: x\nresources: {candidates: [{accelerators: T4:4}]}")
    assert found.startswith("resources.candidates") and "did you mean 'any_of'?" in found


def test_a_relative_mount_destination_lands_under_the_workdir(tmp_path: Path) -> None:
    # SkyPilot's backend puts a relative destination under ~/sky_workdir, not the home
    assert node_path("relative_dir", tmp_path) == tmp_path / "sky_workdir" / "relative_dir"
    assert node_path("~/data", tmp_path) == tmp_path / "data"
    assert node_path("/data", tmp_path) == Path("/data")
