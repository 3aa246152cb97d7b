"""The AWS Terraform module, through its example root, validates and applies against a moto
server on loopback."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

TERRAFORM = Path(__file__).resolve().parents[2] / "infra" / "terraform"
PLUGIN_DIRS = [Path("/opt/tf-plugins"), Path.home() / ".terraform.d" / "plugins"]

pytestmark = pytest.mark.skipif(shutil.which("terraform") is None,
                                reason="terraform is not installed (it is on the project image)")


def plugin_dir() -> Path:
    for d in PLUGIN_DIRS:
        if (d / "registry.terraform.io" / "hashicorp" / "aws").is_dir():
            return d
    pytest.skip("no local hashicorp/aws provider plugin directory")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terraform(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = run_terraform(workdir, *args)
    assert proc.returncode == 0, f"terraform {args[0]} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def run_terraform(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TF_IN_AUTOMATION": "1", "CHECKPOINT_DISABLE": "1",
           "TF_CLI_CONFIG_FILE": os.devnull, "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    return subprocess.run(["terraform", *args, "-no-color"], cwd=workdir, env=env, text=True,
                          capture_output=True, timeout=300)


def aws(service: str, url: str):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="test", aws_secret_access_key="test")


@pytest.fixture(scope="module")
def moto_url():
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, moto_url: str) -> Path:
    """A copy of examples/aws and the module it calls (at the same relative path), the example's
    provider pointed at moto by an override file, initialised from local plugins."""
    root = tmp_path_factory.mktemp("tf")
    ignore = shutil.ignore_patterns(".terraform*", "*.tfstate*")
    for folder in ("modules/aws", "examples/aws"):
        shutil.copytree(TERRAFORM / folder, root / folder, ignore=ignore)
    workdir = root / "examples" / "aws"
    services = ["ec2", "iam", "ssm", "sts", "elasticache"]
    endpoints = "\n".join(f'    {s} = "{moto_url}"' for s in services)
    (workdir / "moto_override.tf").write_text(f"""
provider "aws" {{
  access_key                  = "test"
  secret_key                  = "test"
  skip_credentials_validation = true
  skip_requesting_account_id  = true
  skip_metadata_api_check     = true
  endpoints {{
{endpoints}
  }}
}}
""")
    terraform(workdir, "init", "-backend=false", "-input=false", f"-plugin-dir={plugin_dir()}")
    terraform(workdir, "validate")
    return workdir


def test_module_applies_against_moto_and_tags_what_it_creates(workdir: Path,
                                                              moto_url: str) -> None:
    ec2 = aws("ec2", moto_url)
    ami = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    token = "t" * 40

    # the host's own redis-server: moto has no ElastiCache parameter groups, so the managed
    # path is planned (below), not applied
    terraform(workdir, "apply", "-auto-approve", "-input=false", f"-var=ami_id={ami}",
              f"-var=api_token={token}", "-var=managed_redis=false")
    outputs = json.loads(terraform(workdir, "output", "-json").stdout)

    instance_id = outputs["broker_instance_id"]["value"]
    reservations = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    instance = reservations[0]["Instances"][0]
    tags = {t["Key"]: t["Value"] for t in instance["Tags"]}
    assert tags["fleetbroker:deployment"] == "fleetbroker"
    assert instance["MetadataOptions"]["HttpTokens"] == "required"
    assert outputs["broker_url"]["value"].endswith(":8080")
    ssm = aws("ssm", moto_url)
    param = ssm.get_parameter(Name=outputs["api_token_parameter"]["value"], WithDecryption=True)
    assert param["Parameter"]["Type"] == "SecureString"
    assert param["Parameter"]["Value"] == token
    attribute = ec2.describe_instance_attribute(InstanceId=instance_id, Attribute="userData")
    boot_script = base64.b64decode(attribute["UserData"]["Value"]).decode()
    assert "fleet up --host 0.0.0.0 --port 8080" in boot_script
    assert token not in boot_script  # read from SSM at boot, never baked into user data


def test_managed_redis_plans_with_auth_token_and_its_own_key(workdir: Path,
                                                            tmp_path: Path) -> None:
    redis_token = "r" * 40
    plan = tmp_path / "plan"
    terraform(workdir, "plan", "-input=false", "-var=ami_id=ami-1", f"-var=api_token={'t' * 40}",
              f"-var=redis_auth_token={redis_token}", f"-out={plan}")
    shown = json.loads(terraform(workdir, "show", "-json", str(plan)).stdout)
    planned = {r["address"]: r["values"]
               for r in shown["planned_values"]["root_module"]["child_modules"][0]["resources"]}
    group = planned["module.fleetbroker.aws_elasticache_replication_group.state[0]"]
    assert group["auth_token"] == redis_token and group["transit_encryption_enabled"] is True
    assert "module.fleetbroker.aws_kms_key.state[0]" in planned
    assert planned["module.fleetbroker.aws_ssm_parameter.redis_url[0]"]["type"] == "SecureString"


def test_managed_redis_without_auth_token_is_refused(workdir: Path) -> None:
    proc = run_terraform(workdir, "plan", "-input=false", "-var=ami_id=ami-1",
                         f"-var=api_token={'t' * 40}")
    assert proc.returncode != 0
    assert "managed_redis needs redis_auth_token" in " ".join((proc.stdout + proc.stderr).split())


def test_short_api_token_is_refused_with_the_fix(workdir: Path) -> None:
    proc = run_terraform(workdir, "plan", "-input=false", "-var=ami_id=ami-1",
                         "-var=api_token=short")
    assert proc.returncode != 0
    message = " ".join((proc.stdout + proc.stderr).split())
    assert "api_token must be at least 32 characters" in message
    assert "openssl rand -hex 32" in message
