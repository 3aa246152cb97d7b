"""The agent's reports to the broker: a heartbeat leaves out the progress the node does not have
(a real broker API over redis-server keeps what it had); whether a move resumes the job, as
its workers' progress file tells (none: a plain script, which restarts from the beginning);
and the final report, with the exit
code, is tried again while the broker drops connections or answers that it cannot take it now
(503, as the API does while Redis is away; 429), until it answers otherwise. It also says how
the job's loop takes a resize: in place or by a restart, and whether its batch must split
evenly."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import ClassVar

import pytest

from broker.auth import attempt_token
from tests.api_server import TOKENS, api_stack
from tests.http_stub import serve
from tests.runtime.jobs import ROOT, job_env
from tests.runtime.test_agent_rendezvous import running_job

# A worker that fails after half a second (heartbeats go out meanwhile) and writes no progress.
WORKER = "import sys, time; time.sleep(0.5); sys.exit(3)"


def run_agent(tmp: Path, broker_url: str, worker: str = WORKER,
              **fleet: object) -> subprocess.CompletedProcess[str]:
    """A one-node agent running ``worker`` (default: one that fails without writing progress)."""
    env = job_env(tmp, **{"broker_url": broker_url, "heartbeat_interval": 0.1, **fleet})
    return subprocess.run(
        [sys.executable, "-m", "broker.runtime.agent", "--", sys.executable, "-c", worker],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_heartbeat_leaves_out_the_progress_the_node_lacks(tmp_path: Path) -> None:
    """A node whose worker wrote no progress yet (a new round's, say) must not report
    samples_done 0 for 'not known yet': the broker keeps the job's progress."""
    with api_stack(tmp_path) as (server, store):
        job = running_job(store, nodes=1)
        store.record_heartbeat(job.id, 1, samples_done=500, samples_per_sec=40.0, world_size=1,
                               global_batch_size=32, checkpoint_step=7, checkpoint_bytes=99)
        done = run_agent(tmp_path, server.url, job_id=job.id, attempt=1,
                         agent_token=attempt_token(TOKENS["agent"], job.id, 1))
        assert done.returncode == 3, done.stderr
        got = store.get_job(job.id)
        assert got is not None
        assert (got.samples_done, got.samples_per_sec, got.checkpoint_step,
                got.checkpoint_bytes) == (500, 40.0, 7, 99)
        assert store.agent_reports([got])[got.id].exit_code == 3
        assert got.resumable is False  # it ended without ever reporting progress


# What the runtime writes to the progress file (a step done; checkpoints on or off).
REPORTS = ("import json, os, time; open(os.environ['FLEET_PROGRESS_FILE'], 'w').write("
           "json.dumps({'step': 1, 'samples_done': 32%s})); time.sleep(0.5)")


@pytest.mark.parametrize(("extra", "resumable"), [("", True), (", 'resumable': True", True),
                                                  (", 'resumable': False", False)])
def test_the_broker_learns_from_the_progress_file_whether_a_move_resumes_the_job(
        tmp_path: Path, extra: str, resumable: bool) -> None:
    """Workers that write the progress file resume where they stopped, unless it says their
    checkpoints are off; the grace (FLEET_PROGRESS_GRACE 0: at once) does not matter then."""
    with api_stack(tmp_path) as (server, store):
        job = running_job(store, nodes=1)
        done = run_agent(tmp_path, server.url, REPORTS % extra, job_id=job.id, attempt=1,
                         progress_grace=0,
                         agent_token=attempt_token(TOKENS["agent"], job.id, 1))
        assert done.returncode == 0, done.stderr
        got = store.get_job(job.id)
        assert got is not None and got.resumable is resumable and got.samples_done == 32


@pytest.mark.parametrize(("extra", "in_place", "even"), [
    (", 'resize_generation': 0", True, None),  # the runtime's own loop over a DDP model
    (", 'resize_generation': None, 'even_batch': True", False, True),  # an HF or Lightning job
])
def test_the_broker_learns_how_the_jobs_loop_takes_a_resize(
        tmp_path: Path, extra: str, in_place: bool, even: bool | None) -> None:
    """The heartbeat says whether a resize on the node keeps the workers' processes (rank 0's
    progress has a resize generation: one node, one worker per GPU) and passes on whether the
    global batch must divide over the workers; the job's record keeps both, which the
    scheduler prices resizes and offers batches by."""
    with api_stack(tmp_path) as (server, store):
        job = running_job(store, nodes=1)
        assert (job.resize_in_place, job.even_batch) == (None, None)  # not known: a restart
        done = run_agent(tmp_path, server.url, REPORTS % extra, job_id=job.id, attempt=1,
                         agent_token=attempt_token(TOKENS["agent"], job.id, 1))
        assert done.returncode == 0, done.stderr
        got = store.get_job(job.id)
        assert got is not None and got.samples_done == 32
        assert (got.resize_in_place, got.even_batch) == (in_place, even)


class Flaky(BaseHTTPRequestHandler):
    """A broker that drops the first request's connection without a word, answers the next
    ones 503 (its Redis away) and 429 (busy), then 404: an answer that no retry changes."""

    answers = (None, 503, 429, 404)  # None: drop the connection; the last one repeats
    bodies: ClassVar[list[dict]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        status = self.answers[min(len(self.bodies), len(self.answers)) - 1]
        if status is None:
            self.close_connection = True
            return
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def flaky() -> Iterator[tuple[str, type[Flaky]]]:
    handler = type("FlakyBroker", (Flaky,), {"bodies": []})
    with serve(handler) as url:
        yield url, handler


def test_the_final_report_is_tried_until_the_broker_takes_it(
        tmp_path: Path, flaky: tuple[str, type[Flaky]]) -> None:
    url, broker = flaky
    done = run_agent(tmp_path, url, heartbeat_interval=60, job_id="job-4", attempt=2, round=1)
    assert done.returncode == 3, done.stderr
    # dropped, 503, 429: tried again each time; the 404 ends the tries
    assert [b.get("exit_code") for b in broker.bodies] == [3, 3, 3, 3]
    assert {(b["job_id"], b["attempt"], b["round"], b["state"]) for b in broker.bodies} == {
        ("job-4", 2, 1, "failed")}
    assert not [b for b in broker.bodies if "samples_done" in b or "step" in b]
    assert done.stderr.count("the broker did not take the final report; trying again") == 3
    assert "heartbeat not taken: HTTP Error 503" in done.stderr
    assert "heartbeat not taken: HTTP Error 429" in done.stderr
