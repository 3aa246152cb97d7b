"""The Terraform modules (AWS, GCP, Azure) and their examples, checked statically (no provider
binary for GCP or Azure is on these machines, so ``terraform validate`` cannot run for them; the
AWS one is applied in test_terraform_aws.py): ``terraform fmt -check``, parsing with python-hcl2,
every ``var.X`` declared with a type and a description, every output described, every template's
variables given by its ``templatefile`` call, no secret handed to a boot script, no provider
block in a module, each example passing every input its module requires, and ``checkov`` with no
failed check and a reason on every skipped one (checkov lives in its own venv, ``make setup``'s
``.venv/checkov``: its pins would downgrade the broker's own dependencies)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import pytest

ROOT = Path(__file__).resolve().parents[2]
TERRAFORM = ROOT / "infra" / "terraform"
CHECKOV = shutil.which("checkov") or next(
    (str(p) for p in [ROOT / ".venv" / "checkov" / "bin" / "checkov"] if p.exists()), None)
MODULES = {"aws": {"aws_instance", "aws_ssm_parameter", "aws_elasticache_replication_group"},
           "gcp": {"google_compute_instance", "google_secret_manager_secret",
                   "google_redis_instance"},
           "azure": {"azurerm_linux_virtual_machine", "azurerm_key_vault",
                     "azurerm_redis_cache"}}


def parse(folder: Path) -> dict[str, list[Any]]:
    """Every block of the folder's .tf files, by kind (resource, variable, output, ...)."""
    blocks: dict[str, list[Any]] = {}
    for tf in sorted(folder.glob("*.tf")):
        with tf.open() as f:
            for kind, items in hcl2.load(f).items():
                blocks.setdefault(kind, []).extend(items)
    return blocks


def source(folder: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(folder.glob("*.tf")))


def names(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {k.strip('"'): v for item in items for k, v in item.items()}


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform is not installed")
def test_terraform_fmt() -> None:
    env = {**os.environ, "TF_CLI_CONFIG_FILE": os.devnull, "CHECKPOINT_DISABLE": "1"}
    for folder in ("modules", "examples"):
        r = subprocess.run(["terraform", "fmt", "-check", "-recursive", "-diff", folder],
                           cwd=TERRAFORM, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"terraform fmt would change:\n{r.stdout}{r.stderr}"


@pytest.mark.parametrize("cloud", sorted(MODULES))
def test_module_is_complete_and_consistent(cloud: str) -> None:
    folder = TERRAFORM / "modules" / cloud
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf", "README.md"):
        assert (folder / name).is_file(), f"{cloud}: no {name} (standard module layout)"
    blocks = parse(folder)
    resources = {kind.strip('"') for item in blocks["resource"] for kind in item}
    assert MODULES[cloud] <= resources
    variables = names(blocks["variable"])
    for name, spec in variables.items():
        assert spec.get("description") and spec.get("type"), f"{cloud}: variable {name}"
    for name, spec in names(blocks["output"]).items():
        assert spec.get("description"), f"{cloud}: output {name} has no description"
    text = source(folder)
    used = set(re.findall(r"\bvar\.([a-z_][a-z0-9_]*)", text))
    assert used <= set(variables), f"{cloud}: undeclared {used - set(variables)}"
    assert set(variables) <= used, f"{cloud}: unused {set(variables) - used}"
    assert variables["api_token"].get("sensitive") is True
    # a module that configures its provider cannot be used with the caller's (region, account)
    assert "provider" not in blocks, f"{cloud}: provider block in the module"


@pytest.mark.parametrize("cloud", sorted(MODULES))
def test_boot_script_gets_its_variables_and_no_secret(cloud: str) -> None:
    folder = TERRAFORM / "modules" / cloud
    text = source(folder)
    (call,) = re.findall(r'templatefile\("\$\{path\.module\}/([^"]+)", \{(.*?)\n\s*\}\)', text,
                         re.S)
    template, args = call
    given = set(re.findall(r"^\s*([a-z_]+)\s*=", args, re.M))
    body = (folder / template).read_text()
    wanted = set(re.findall(r"(?<![$\\])\$\{([a-z_][a-z0-9_]*)\}", body)) | set(
        re.findall(r"%\{ if ([a-z_]+)", body))
    assert wanted == given, f"{cloud}: template wants {wanted}, gets {given}"
    secrets = {n for n, spec in names(parse(folder)["variable"]).items() if spec.get("sensitive")}
    assert secrets and not any(f"var.{n}" in args for n in secrets), f"{cloud}: a secret"
    # nor a managed Redis' credential: each boot script reads the Redis URL from the secret store
    for word in ("password", "auth_token", "auth_string", "access_key"):
        assert word not in args.lower(), f"{cloud}: {word} handed to the boot script"


@pytest.mark.parametrize("cloud", sorted(MODULES))
def test_example_uses_the_module_with_its_required_inputs(cloud: str) -> None:
    module_vars = names(parse(TERRAFORM / "modules" / cloud)["variable"])
    required = {n for n, spec in module_vars.items() if "default" not in spec}
    (call,) = names(parse(TERRAFORM / "examples" / cloud)["module"]).values()
    assert call["source"].strip('"') == f"../../modules/{cloud}"
    passed = set(call) - {"source", "__is_block__"}
    assert required <= passed, f"example misses {required - passed}"
    assert passed <= set(module_vars), f"example passes unknown {passed - set(module_vars)}"


EXAMPLES = sorted(p.name for p in (TERRAFORM / "examples").iterdir() if p.is_dir())


@pytest.mark.skipif(CHECKOV is None, reason="checkov is not installed (make setup puts it in "
                    ".venv/checkov)")
@pytest.mark.parametrize("folder, var_file", [
    *[(f"modules/{cloud}", f"managed_redis = {on}") for cloud in sorted(MODULES)
      for on in ("false", "true")],  # a resource with count = 0 is not scanned: both paths
    *[(f"examples/{name}", None) for name in EXAMPLES]])
def test_checkov_finds_nothing_unexplained(folder: str, var_file: str | None,
                                           tmp_path: Path) -> None:
    assert CHECKOV is not None
    args = [CHECKOV, "-d", str(TERRAFORM / folder), "--framework", "terraform", "--skip-download",
            "-o", "json"]
    if var_file is not None:
        (tmp_path / "scan.tfvars").write_text(var_file + "\n")
        args += ["--var-file", str(tmp_path / "scan.tfvars")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    report = json.loads(r.stdout)
    results = report["results"]
    failed = [(c["check_id"], c["resource"]) for c in results["failed_checks"]]
    assert not failed and not results["parsing_errors"], failed
    assert report["summary"]["passed"] > 0
    for check in results["skipped_checks"]:  # every skip says why, in the module's source
        assert (check["check_result"].get("suppress_comment") or "").strip(), check["check_id"]


def test_every_module_has_an_example() -> None:
    assert sorted(MODULES) == EXAMPLES
