"""Issue 13, items 1, 7 and 10a against a real redis-server: the embedded server refuses a client
without its password (kept 0600, never on a command line), keeps its files owner-only, runs once
per data directory (a lock; a server an earlier broker left is stopped; the server dies with its
broker), and an external Redis may be ``rediss://`` with an ACL user, whose password stays out
of ``fleet up``'s output."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from broker.models import JobState
from broker.server import EmbeddedRedis, _redis_servers_in
from broker.store import Store
from policies.models import BatchRange, GpuRange, JobSpec
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]


def raw(port: int, *lines: bytes) -> bytes:
    """What a plain client with no credentials gets from ``port`` (RESP inline commands)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"".join(line + b"\r\n" for line in lines))
        time.sleep(0.2)
        return s.recv(4096)


def private(path: Path) -> list[str]:
    """Everything under ``path`` (itself included) that its group or others may touch."""
    bad = []
    for p in [path, *path.rglob("*")]:
        mode = p.lstat().st_mode
        if not stat.S_ISLNK(mode) and mode & 0o077:
            bad.append(f"{p.relative_to(path.parent)} {stat.filemode(mode)}")
    return bad


def test_embedded_redis_refuses_clients_without_its_password(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        reply = raw(server.port, b"PING", b"KEYS *", b"SET fb:job:x hacked")
        assert reply.count(b"-NOAUTH") == 3, reply
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, password="wrong").ping()
        store = Store.from_url(server.url)  # the broker's URL carries it
        store.submit(JobSpec(name="a", run="true", gpus=GpuRange(min=1, max=1),
                             batch_size=BatchRange(min=8, max=8), work_samples=8), team="t")
        assert [j.state for j in store.list_jobs()] == [JobState.QUEUED]
        password = (tmp_path / "redis" / "password").read_text().strip()
        assert len(password) >= 32 and password == server.password
        cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes()  # type: ignore[union-attr]
        assert password.encode() not in cmdline  # visible to every local user
        assert private(tmp_path / "redis") == []  # AOF, password, lock: 0600 in 0700
    finally:
        server.stop()
    again = EmbeddedRedis(tmp_path / "redis").start()  # same password, same data
    try:
        assert again.password == password
        assert len(Store.from_url(again.url).list_jobs()) == 1
    finally:
        again.stop()


def test_embedded_redis_has_no_default_user_and_a_least_privilege_broker_user(
        tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        password = server.password
        assert password is not None
        # the default user is off: neither no password nor the broker's password opens it
        assert b"-NOAUTH" in raw(server.port, b"PING")
        for client in (redis.Redis(port=server.port, password=password),
                       redis.Redis(port=server.port, username="default", password=password),
                       redis.Redis(port=server.port, username="default", password="")):
            with pytest.raises(redis.AuthenticationError):
                client.ping()
        broker = Store.from_url(server.url).r
        assert broker.acl_whoami() == server.user != "default"
        broker.set("fb:probe", "1")
        # what a leaked broker password must not do: reconfigure the server (CONFIG SET dir and
        # dbfilename write any file Redis can), stop it, read other prefixes' keys
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("SHUTDOWN", "NOSAVE"),
                        ("ACL", "LIST"), ("MONITOR",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                broker.execute_command(*command)
        with pytest.raises(redis.exceptions.NoPermissionError):
            broker.get("other:key")
        assert broker.get("fb:probe") == "1"
    finally:
        server.stop()


def test_one_embedded_redis_per_data_directory(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis").start()
    try:
        with pytest.raises(RuntimeError, match=r"is in use: process \d+ runs the embedded Redis"):
            EmbeddedRedis(tmp_path / "redis").start()
        assert _redis_servers_in(tmp_path / "redis") == [first.proc.pid]  # type: ignore[union-attr]
        first.restart(kill=True)  # a restart keeps the directory
        assert len(_redis_servers_in(tmp_path / "redis")) == 1
    finally:
        first.stop()
    assert _redis_servers_in(tmp_path / "redis") == []


# A broker stand-in that starts the embedded Redis, writes a key, says so and waits to be killed.
# From a thread: no parent-death signal, as on a platform without one (the orphan case).
HOLDER = """
import sys, threading, time
from pathlib import Path
from broker.server import EmbeddedRedis
import redis
box = {}
def start():
    box["r"] = EmbeddedRedis(Path(sys.argv[1])).start()
t = threading.Thread(target=start) if sys.argv[2] == "thread" else None
t.start() if t else start()
t.join() if t else None
r = box["r"]
redis.Redis.from_url(r.url).set("fb:kept", "yes")
print(r.port, flush=True)
time.sleep(120)
"""


def holder(data: Path, how: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(data), how], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def wait_until(cond, timeout: float = 15) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_redis_dies_with_its_broker(tmp_path: Path) -> None:
    proc, _ = holder(tmp_path / "redis", "main")
    assert len(_redis_servers_in(tmp_path / "redis")) == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not _redis_servers_in(tmp_path / "redis"))


def test_a_redis_left_by_a_killed_broker_is_stopped_and_its_data_kept(tmp_path: Path) -> None:
    proc, port = holder(tmp_path / "redis", "thread")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)
    (orphan,) = _redis_servers_in(tmp_path / "redis")  # kill -9 of the broker left it running
    assert b"-NOAUTH" in raw(port, b"PING")
    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        assert _redis_servers_in(tmp_path / "redis") == [server.proc.pid]  # type: ignore[union-attr]
        assert orphan != server.proc.pid  # type: ignore[union-attr]
        assert redis.Redis.from_url(server.url).get("fb:kept") == b"yes"
    finally:
        server.stop()


# ---- an external Redis: TLS and an ACL user ---------------------------------------------------

def tls_material(tmp: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 (openssl)."""
    files = {k: tmp / f"{k}.pem" for k in ("ca", "ca-key", "cert", "key")}
    ext = tmp / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    run = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fleet-ca",
         "-keyout", files["ca-key"], "-out", files["ca"]],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", files["key"], "-out", tmp / "req.pem"],
        ["x509", "-req", "-in", tmp / "req.pem", "-CA", files["ca"], "-CAkey", files["ca-key"],
         "-CAcreateserial", "-days", "1", "-extfile", ext, "-out", files["cert"]],
    ]
    for args in run:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return files


def test_rediss_with_an_acl_user_and_no_password_in_fleet_up_output(tmp_path: Path) -> None:
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("no openssl to make a certificate")
    tls = tls_material(tmp_path)
    port, password = free_port(), "acl-user-s3cret-0123456789"
    conf = textwrap.dedent(f"""\
        port 0
        tls-port {port}
        bind 127.0.0.1
        tls-cert-file {tls['cert']}
        tls-key-file {tls['key']}
        tls-ca-cert-file {tls['ca']}
        tls-auth-clients no
        save ""
        appendonly yes
        dir {tmp_path}
        user default off
        user fleet on >{password} ~* &* +@all
        """)
    server = subprocess.Popen(["redis-server", "-"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert server.stdin is not None
    server.stdin.write(conf.encode())
    server.stdin.close()
    url = f"rediss://fleet:{password}@127.0.0.1:{port}/0?ssl_ca_certs={tls['ca']}"
    try:
        store = Store.from_url(url)
        assert wait_until(lambda: _ping(store))
        job = store.submit(JobSpec(name="tls", run="true", gpus=GpuRange(min=1, max=1),
                                   batch_size=BatchRange(min=8, max=8), work_samples=8), team="t")
        assert store.get_job(job.id) is not None
        with pytest.raises(redis.RedisError):  # the default user is off: no anonymous access
            redis.Redis(port=port, ssl=True, ssl_ca_certs=str(tls["ca"])).ping()
        fleet = tmp_path / "fleet.yaml"
        fleet.write_text("regions:\n  - {region: here, price_per_gpu_hour: 1, gpus: 1}\n")
        for variant in (url, url.replace(password, "wrong-password-0123456789")):
            out = fleet_up_output(tmp_path, fleet, variant)
            assert "wrong-password" not in out and password not in out, out
        assert "rediss://fleet:****@127.0.0.1" in fleet_up_output(tmp_path, fleet, url)
    finally:
        server.terminate()
        server.wait(timeout=10)


def _ping(store: Store) -> bool:
    try:
        return bool(store.r.ping())
    except redis.RedisError:
        return False


def fleet_up_output(tmp: Path, fleet: Path, url: str) -> str:
    """``fleet up`` with ``FLEET_REDIS_URL`` for a few seconds: all it printed."""
    env = {**os.environ, "FLEET_REDIS_URL": url, "FLEET_CONFIG": str(tmp / "client.yaml")}
    up = subprocess.Popen(
        [sys.executable, "-m", "broker", "up", "--state-dir", str(tmp / "state"), "--fleet",
         str(fleet), "--port", str(free_port())], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    time.sleep(6)
    up.send_signal(signal.SIGINT)
    try:
        out, _ = up.communicate(timeout=30)
    finally:
        up.kill()
    return out
