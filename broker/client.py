"""A small HTTP client for the broker's API, and where the CLI finds the broker URL and token.

Resolution order: flags, then ``FLEET_URL``/``FLEET_TOKEN``, then the client config file
(``$FLEET_CONFIG``, else ``$XDG_CONFIG_HOME/fleet/config.yaml``, else
``~/.config/fleet/config.yaml``).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml

from broker import errors
from broker.models import MAX_NOTE_CHARS, MAX_NOTES
from broker.protocol import BrokerEnv
from broker.spec import LAUNCH_MEDIA, Problem

DEFAULT_URL = "http://127.0.0.1:8470"



class BrokerUnreachable(errors.Unavailable):
    """No answer from the broker, or not the API's: worth one retry of a keyed submission."""


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(BrokerEnv.CONFIG):
        return Path(env[BrokerEnv.CONFIG])
    base = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else (
        Path.home() / ".config")
    return base / "fleet" / "config.yaml"


def read_client_config(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    path = config_path(environ)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        return {}
    except (OSError, yaml.YAMLError) as exc:
        raise errors.InvalidInput(
            f"{path}: cannot read the client config ({exc}); fix or delete it") from None
    if not isinstance(data, Mapping) or set(data) - {"url", "token"}:
        raise errors.InvalidInput(f"{path}: write a mapping with url and token only")
    return {k: str(v) for k, v in data.items() if v is not None}


def write_client_config(url: str, token: str, environ: Mapping[str, str] | None = None) -> Path:
    """Save the broker URL and token for later ``fleet`` commands (owner-only file mode)."""
    path = config_path(environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({"url": url, "token": token}, f)
    os.chmod(path, 0o600)
    return path


class BrokerClient:
    """Calls the API; every failure becomes a ``broker.errors.FleetError`` (the class of the
    answer's status) with the broker's message."""

    def __init__(self, url: str | None = None, token: str | None = None, *,
                 timeout: float = 30.0, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        saved = read_client_config(env) if not (url or env.get(BrokerEnv.URL)) or not (
            token or env.get(BrokerEnv.TOKEN)) else {}
        self.url = (url or env.get(BrokerEnv.URL) or saved.get("url") or DEFAULT_URL).rstrip("/")
        self.token = token or env.get(BrokerEnv.TOKEN) or saved.get("token")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- calls --------------------------------------------------------------------------

    def submit(self, spec_json: str, *, idempotency_key: str | None = None,
               notes: Sequence[str] = (),
               secrets: dict[str, str] | None = None) -> dict[str, Any]:
        """Submit a spec. ``notes``: what translating it left out or changed, kept on the job;
        ``secrets`` (the values of its ``secret_envs``) go beside it, and the broker seals
        them."""
        key = idempotency_key or uuid.uuid4().hex
        headers = {"Content-Type": "application/json", "Idempotency-Key": key}
        if secrets:
            headers["Content-Type"] = LAUNCH_MEDIA
            spec_json = json.dumps({"spec": spec_json, "secrets": secrets})
        # The key makes one retry after a dropped connection safe: no second job.
        for attempt in (1, 2):
            try:
                return self._call("POST", "/v1/jobs", content=spec_json, headers=headers,
                                  params={"note": [n[:MAX_NOTE_CHARS]
                                                   for n in notes[:MAX_NOTES]]})
            except BrokerUnreachable:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def preview(self, spec_json: str) -> dict[str, Any]:
        """What the job would get, without submitting it (``POST /v1/jobs/preview``)."""
        return self._call("POST", "/v1/jobs/preview", content=spec_json,
                          headers={"Content-Type": "application/json"})

    def put_blob(self, data: bytes) -> dict[str, Any]:
        """Upload a packed workdir or file mount; ``{"ref", "bytes"}``."""
        return self._call("POST", "/v1/blobs", content=data,
                          headers={"Content-Type": "application/octet-stream"})

    def jobs(self, *, states: list[str] | None = None, team: str | None = None
             ) -> dict[str, Any]:
        params: dict[str, Any] = {"state": states or []}
        if team:
            params["team"] = team
        return self._call("GET", "/v1/jobs", params=params)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{_seg(job_id)}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/v1/jobs/{_seg(job_id)}/cancel")

    def logs(self, job_id: str, offset: int = 0, limit: int = 1000) -> dict[str, Any]:
        return self._call("GET", f"/v1/jobs/{_seg(job_id)}/logs",
                          params={"offset": offset, "limit": limit})

    def capacity(self) -> dict[str, Any]:
        return self._call("GET", "/v1/capacity")

    def costs(self, *, team: str | None = None, states: list[str] | None = None,
              limit: int = 1000) -> dict[str, Any]:
        params: dict[str, Any] = {"state": states or [], "limit": limit}
        if team:
            params["team"] = team
        return self._call("GET", "/v1/costs", params=params)

    def events(self, *, since: str = "0", job_id: str | None = None,
               limit: int = 100) -> dict[str, Any]:
        params: dict[str, Any] = {"since": since, "limit": limit}
        if job_id:
            params["job_id"] = job_id
        return self._call("GET", "/v1/events", params=params)

    def preempt(self, region: str, duration_s: float = 60.0) -> dict[str, Any]:
        return self._call("POST", "/v1/chaos/preempt",
                          json={"region": region, "duration_s": duration_s})

    def node_chaos(self, job_id: str, rank: int, how: str) -> dict[str, Any]:
        return self._call("POST", "/v1/chaos/node",
                          json={"job_id": job_id, "rank": rank, "how": how})

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise BrokerUnreachable(
                f"cannot reach the broker at {self.url} ({type(exc).__name__}); start it with "
                f"`fleet up`, or point {BrokerEnv.URL} / --url at a running one",
            ) from None
        if r.status_code < 400:
            try:
                return r.json()
            except ValueError:
                raise BrokerUnreachable(f"{self.url} answered, but not as a FleetBroker API; "
                                        f"check {BrokerEnv.URL} / --url") from None
        try:
            err = r.json()["error"]
            message = err["message"]
            problems = [Problem.model_validate(p) for p in err.get("problems", [])]
        except (ValueError, KeyError, TypeError):
            message, problems = f"HTTP {r.status_code}: {r.text[:200]}", []
        if r.status_code == 401 and not self.token:
            message += (f"; no token configured: set {BrokerEnv.TOKEN}, pass --token, or run "
                        "fleet login")
        raise errors.for_status(r.status_code)(message, problems)


def _seg(job_id: str) -> str:
    """A job id as one path segment (a bad id is then a clean 404/422, never another route)."""
    return quote(job_id, safe="")
