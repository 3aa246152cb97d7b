"""Preemption notices from the clouds' instance metadata services (stdlib HTTP only).

Each poller returns a one-line reason when the node is about to be reclaimed, else None. A metadata
service that cannot be reached is not a notice: the poll simply says nothing this time.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

TIMEOUT_S = 2.0


def _get(url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError, TimeoutError):
        return 0, b""


@dataclass
class AwsNotice:
    """``spot/instance-action``: 404 until the two-minute notice, then JSON {action, time}.

    IMDSv2-only instances answer 401 without a session token; then we fetch one and retry.
    """

    url: str
    token: str | None = field(default=None, repr=False)

    def _token(self) -> str | None:
        base = self.url.split("/latest/")[0]
        request = urllib.request.Request(
            f"{base}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"},
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError, TimeoutError):
            return None

    def __call__(self) -> str | None:
        headers = {"X-aws-ec2-metadata-token": self.token} if self.token else {}
        status, body = _get(self.url, headers)
        if status == 401:
            self.token = self._token()
            if self.token:
                status, body = _get(self.url, {"X-aws-ec2-metadata-token": self.token})
        if status != 200:
            return None
        try:
            notice = json.loads(body)
        except ValueError:
            return None
        action = notice.get("action") if isinstance(notice, dict) else None
        if action not in ("terminate", "stop", "hibernate"):
            return None
        return f"aws spot instance-action {action} at {notice.get('time', '?')}"


@dataclass
class GcpNotice:
    """``instance/preempted``: TRUE once the 30-second preemption notice has been given."""

    url: str

    def __call__(self) -> str | None:
        status, body = _get(self.url, {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == b"TRUE":
            return "gcp instance preempted"
        return None


@dataclass
class AzureNotice:
    """Scheduled Events: a ``Preempt`` event for this VM (spot eviction, about 30 s ahead)."""

    url: str

    def __call__(self) -> str | None:
        status, body = _get(self.url, {"Metadata": "true"})
        if status != 200:
            return None
        try:
            events = json.loads(body).get("Events", [])
        except (ValueError, AttributeError):
            return None
        for event in events:
            if isinstance(event, dict) and event.get("EventType") == "Preempt":
                return f"azure scheduled event Preempt {event.get('EventId', '')}".strip()
        return None


def pollers(
    aws_url: str | None, gcp_url: str | None, azure_url: str | None
) -> list[Callable[[], str | None]]:
    """One poller per configured endpoint."""
    found: list[Callable[[], str | None]] = []
    if aws_url:
        found.append(AwsNotice(aws_url))
    if gcp_url:
        found.append(GcpNotice(gcp_url))
    if azure_url:
        found.append(AzureNotice(azure_url))
    return found
