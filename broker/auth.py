"""API settings and bearer tokens: who a token is (a team, an admin or a job's agent).

Only SHA-256 hashes of tokens are kept in memory; a presented token is hashed and compared with
``hmac.compare_digest`` against every grant, so neither the token nor timing leaks. A launched
job gets no fleet-wide token: its agent gets an attempt token, an HMAC of ``job_id:attempt``
under the broker's key, good for that attempt's heartbeats and rendezvous visits only (a job's
code cannot speak for another job).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from broker.errors import InvalidInput
from broker.files import DEFAULT_BLOB_QUOTA_BYTES
from broker.protocol import BrokerEnv
from broker.spec import MAX_SPEC_BYTES
from policies.models import check_name

MIN_TOKEN_CHARS = 16


class Role(StrEnum):
    TEAM = "team"  # submits and sees its own jobs only
    ADMIN = "admin"  # sees every job, may preempt regions (chaos)
    AGENT = "agent"  # a job's agent: may post heartbeats and rendezvous visits only
    METRICS = "metrics"  # a Prometheus scraper: may read /metrics only


class Principal(BaseModel):
    """Who made a request."""

    model_config = ConfigDict(frozen=True)

    role: Role
    team: str | None = None

    def can_see(self, team: str) -> bool:
        return self.role is Role.ADMIN or (self.role is Role.TEAM and self.team == team)


class TokenGrant(BaseModel):
    """One accepted token, by its SHA-256 hex digest."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: Role
    team: str | None = None

    @field_validator("team")
    @classmethod
    def _team(cls, v: str | None) -> str | None:
        return None if v is None else check_name(v, "team")


class ConfigError(InvalidInput):
    """The broker's API settings are invalid; the message names the entry and the fix."""


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def attempt_token(key: str, job_id: str, attempt: int) -> str:
    """The bearer token of one attempt of one job: HMAC-SHA256 of ``job_id:attempt``."""
    mac = hmac.new(key.encode("utf-8"), f"{job_id}:{attempt}".encode(), hashlib.sha256)
    return mac.hexdigest()


def is_attempt_shaped(token: str) -> bool:
    """Could ``token`` be an attempt token (64 hex digits)? Which attempt it is for, only the
    report it comes with can tell."""
    return len(token) == 64 and all(ch in "0123456789abcdef" for ch in token)


class ApiConfig(BaseModel):
    """The ``api:`` section of the broker config."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[TokenGrant] = Field(default_factory=list, description="a list of {team: NAME "
                                     "| admin: true | agent: true, token: TEXT | token_sha256: "
                                     "HEX} (docs/security.md)")
    max_body_bytes: int = Field(default=MAX_SPEC_BYTES + 4096, ge=1024, le=16 * 1024 * 1024,
                                description="the largest request body the API reads")
    max_list: int = Field(default=10_000, ge=1, description="most jobs one listing returns")
    blob_quota_bytes: int = Field(default=DEFAULT_BLOB_QUOTA_BYTES, ge=1,
                                  description="the most bytes of packed workdirs and file "
                                  "mounts (POST /v1/blobs) one team keeps in the state dir; an "
                                  "upload past it is a 413 (broker.blob_retention_s says when "
                                  "unneeded packs are deleted)")
    # The key attempt tokens are made with (the broker's agent key); set at start, never in a file.
    attempt_key: SecretStr | None = Field(default=None, exclude=True)

    def authenticate(self, token: str | None) -> Principal | None:
        if not token:
            return None
        digest = hash_token(token)
        found: TokenGrant | None = None
        for grant in self.tokens:  # no early exit: every grant is compared
            if hmac.compare_digest(grant.sha256, digest):
                found = grant
        return None if found is None else Principal(role=found.role, team=found.team)

    def is_attempt(self, token: str | None, job_id: str, attempt: int) -> bool:
        """Is ``token`` the attempt token of ``job_id``'s attempt ``attempt``?"""
        if not token or self.attempt_key is None:
            return False
        want = attempt_token(self.attempt_key.get_secret_value(), job_id, attempt)
        return hmac.compare_digest(want, token)

    def with_attempt_key(self, key: str) -> ApiConfig:
        """A copy that accepts the attempt tokens made with ``key``."""
        return self.model_copy(update={"attempt_key": SecretStr(key)})

    def with_token(self, token: str, role: Role, team: str | None = None) -> ApiConfig:
        """A copy that also accepts ``token`` (``fleet up`` adds its admin and agent tokens)."""
        grant = _grant(token, role, team, where="with_token")
        return self.model_copy(update={"tokens": [*self.tokens, grant]})

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> ApiConfig:
        """From the ``api:`` mapping; each token entry is ``{team: NAME | admin: true | agent:
        true | metrics: true, token: TEXT | token_sha256: HEX}``."""
        data = dict(data or {})
        entries = data.pop("tokens", None) or []
        if not isinstance(entries, list):
            raise ConfigError("api.tokens: write a list of {team|admin|agent|metrics, "
                              "token|token_sha256}")
        grants = [_entry(e, f"api.tokens[{i}]") for i, e in enumerate(entries)]
        try:
            return cls(tokens=grants, **data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise ConfigError(f"api.{where}: {err['msg']}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> list[TokenGrant]:
        """Tokens from ``FLEET_ADMIN_TOKEN``, ``FLEET_AGENT_TOKEN``, ``FLEET_METRICS_TOKEN`` and
        ``FLEET_TEAM_TOKENS`` (``team=token,team2=token2``)."""
        env = os.environ if environ is None else environ
        grants = []
        if env.get(BrokerEnv.ADMIN_TOKEN):
            grants.append(_grant(env[BrokerEnv.ADMIN_TOKEN], Role.ADMIN, None,
                                 BrokerEnv.ADMIN_TOKEN))
        if env.get(BrokerEnv.AGENT_TOKEN):
            grants.append(_grant(env[BrokerEnv.AGENT_TOKEN], Role.AGENT, None,
                                 BrokerEnv.AGENT_TOKEN))
        if env.get(BrokerEnv.METRICS_TOKEN):
            grants.append(_grant(env[BrokerEnv.METRICS_TOKEN], Role.METRICS, None,
                                 BrokerEnv.METRICS_TOKEN))
        for i, item in enumerate(filter(None, env.get(BrokerEnv.TEAM_TOKENS, "").split(","))):
            team, sep, token = item.strip().partition("=")
            if not sep:
                raise ConfigError(f"{BrokerEnv.TEAM_TOKENS} entry {i + 1}: write team=token pairs "
                                  "separated by commas")
            grants.append(_grant(token, Role.TEAM, team, f"{BrokerEnv.TEAM_TOKENS} entry {i + 1}"))
        return grants

    @classmethod
    def load(cls, section: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> ApiConfig:
        """The ``api`` section of the broker config (``broker.config``) plus the tokens from
        env."""
        config = cls.from_mapping(section)
        return config.model_copy(update={"tokens": [*config.tokens, *cls.from_env(environ)]})


def _entry(entry: Any, where: str) -> TokenGrant:
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: write {{team: NAME, token_sha256: HEX}}")
    unknown = set(entry) - {"team", "admin", "agent", "metrics", "token", "token_sha256"}
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; use team, admin, agent, "
                          "metrics, token or token_sha256")
    roles = [r for r, on in ((Role.ADMIN, entry.get("admin")), (Role.AGENT, entry.get("agent")),
                             (Role.METRICS, entry.get("metrics")),
                             (Role.TEAM, entry.get("team"))) if on]
    if len(roles) != 1:
        raise ConfigError(f"{where}: give exactly one of team: NAME, admin: true, agent: true, "
                          "metrics: true")
    role = roles[0]
    team = entry.get("team") if role is Role.TEAM else None
    if ("token" in entry) == ("token_sha256" in entry):
        raise ConfigError(f"{where}: give token (plain) or token_sha256 (its SHA-256 hex digest)")
    if "token_sha256" in entry:
        digest = str(entry["token_sha256"]).strip().lower()
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ConfigError(f"{where}.token_sha256: write the 64-hex-digit SHA-256 digest "
                              "(python -c 'import hashlib,sys; print(hashlib.sha256("
                              "sys.argv[1].encode()).hexdigest())' TOKEN)")
        return _make(digest, role, team, where)
    return _grant(str(entry["token"]), role, team, where)


def _grant(token: str, role: Role, team: str | None, where: str) -> TokenGrant:
    if len(token) < MIN_TOKEN_CHARS or token != token.strip():
        raise ConfigError(f"{where}: a token needs at least {MIN_TOKEN_CHARS} characters and no "
                          "surrounding spaces (make one with: fleet token)")
    return _make(hash_token(token), role, team, where)


def _make(digest: str, role: Role, team: str | None, where: str) -> TokenGrant:
    try:
        return TokenGrant(sha256=digest, role=role, team=team)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") \
            from None
