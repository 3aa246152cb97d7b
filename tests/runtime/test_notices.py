"""Preemption notice pollers against local metadata servers, and the agent's option checks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pytest_httpserver import HTTPServer

from broker.runtime.agent import parse
from broker.runtime.assignment import AssignmentError
from broker.runtime.notices import AwsNotice, AzureNotice, GcpNotice
from tests.runtime.jobs import ROOT

AWS = "/latest/meta-data/spot/instance-action"
GCP = "/computeMetadata/v1/instance/preempted"
AZURE = "/metadata/scheduledevents"


def test_aws_notice_404_until_instance_action(httpserver: HTTPServer) -> None:
    poll = AwsNotice(httpserver.url_for(AWS))
    httpserver.expect_oneshot_request(AWS).respond_with_data("Not Found", status=404)
    assert poll() is None
    body = {"action": "stop", "time": "2026-12-02T14:00:00Z"}
    httpserver.expect_oneshot_request(AWS).respond_with_json(body)
    assert poll() == "aws spot instance-action stop at 2026-12-02T14:00:00Z"


def test_aws_notice_with_imdsv2_token(httpserver: HTTPServer) -> None:
    httpserver.expect_request("/latest/api/token", method="PUT").respond_with_data("tok")
    httpserver.expect_request(AWS, headers={"X-aws-ec2-metadata-token": "tok"}).respond_with_json(
        {"action": "terminate", "time": "t"})
    httpserver.expect_request(AWS).respond_with_data("", status=401)
    assert AwsNotice(httpserver.url_for(AWS))() == "aws spot instance-action terminate at t"


def test_gcp_notice_needs_the_metadata_flavor_header(httpserver: HTTPServer) -> None:
    poll = GcpNotice(httpserver.url_for(GCP))
    flavor = {"Metadata-Flavor": "Google"}
    httpserver.expect_oneshot_request(GCP, headers=flavor).respond_with_data("FALSE")
    assert poll() is None
    httpserver.expect_oneshot_request(GCP, headers=flavor).respond_with_data("TRUE")
    assert poll() == "gcp instance preempted"


def test_azure_preempt_event(httpserver: HTTPServer) -> None:
    poll = AzureNotice(httpserver.url_for(AZURE) + "?api-version=2020-07-01")
    headers = {"Metadata": "true"}
    reboot = {"DocumentIncarnation": 1, "Events": [{"EventId": "a", "EventType": "Reboot"}]}
    preempt = {"DocumentIncarnation": 2, "Events": [{"EventId": "b", "EventType": "Preempt"}]}
    httpserver.expect_oneshot_request(AZURE, headers=headers).respond_with_json(reboot)
    assert poll() is None
    httpserver.expect_oneshot_request(AZURE, headers=headers).respond_with_json(preempt)
    assert poll() == "azure scheduled event Preempt b"


def test_unreachable_metadata_is_no_notice() -> None:
    assert GcpNotice("http://127.0.0.1:9/computeMetadata/v1/instance/preempted")() is None


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--nproc", "2"], {}, "no command"),
        (["--", "true"], {"FLEET_NPROC": "two"}, "FLEET_NPROC='two' is not an integer"),
        (["--", "true"], {"FLEET_NNODES": "2"},
         "set FLEET_MASTER_ADDR and FLEET_MASTER_PORT .*or FLEET_BROKER_URL"),
        (["--", "true"], {"FLEET_NNODES": "2", "FLEET_MASTER_ADDR": "10.0.0.5"},
         "FLEET_MASTER_PORT is required"),
        (["--", "true"], {"FLEET_ROUND": "-1"}, "FLEET_ROUND=-1 is below 0"),
        (["--", "true"], {"FLEET_NNODES": "2", "FLEET_NODE_RANK": "2"}, "below FLEET_NNODES"),
    ],
)
def test_agent_rejects_bad_options_by_name(argv: list[str], env: dict, message: str) -> None:
    with pytest.raises(AssignmentError, match=message):
        parse(argv, env)


def test_agent_finds_a_multi_node_master_through_the_broker_unless_given_one() -> None:
    env = {"FLEET_NNODES": "2", "FLEET_NODE_RANK": "1", "FLEET_BROKER_URL": "http://b:8080/",
           "FLEET_ROUND": "3", "FLEET_MASTER_PORT": "29500"}
    config, _ = parse(["--", "true"], env)
    assert config.rendezvous and config.master_addr is None and config.round == 3
    assert config.broker_url == "http://b:8080"
    fixed, _ = parse(["--master-addr", "10.0.0.5", "--", "true"], env)
    assert not fixed.rendezvous and (fixed.master_addr, fixed.master_port) == ("10.0.0.5", 29500)
    single, _ = parse(["--", "true"], {"FLEET_BROKER_URL": "http://b"})
    assert not single.rendezvous and single.master_addr == "127.0.0.1"


def test_agent_options_win_over_env_and_bad_input_exits_2() -> None:
    config, command = parse(["--nproc", "3", "--", "python", "x.py", "--", "y"],
                            {"FLEET_NPROC": "1", "FLEET_JOB_ID": "j", "FLEET_ATTEMPT": "4"})
    assert (config.nproc, config.job_id, config.attempt) == (3, "j", 4)
    assert command == ["python", "x.py", "--", "y"]
    run = subprocess.run([sys.executable, "-m", "broker.runtime.agent", "true"], cwd=ROOT,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and "no command" in run.stderr and "Traceback" not in run.stderr
    # The agent and the package import without torch and without the control plane's packages.
    check = ("import sys, broker.runtime.agent, broker.runtime; "
             "print([m for m in ('torch', 'fastapi', 'redis', 'typer') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stderr
