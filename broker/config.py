"""The broker's configuration, in one model: a YAML file (``fleet up --config FILE``), environment
overrides (``FLEET_<SECTION>__<KEY>``, e.g. ``FLEET_SCHEDULER__RESTART_S=60``), then the flags of
``fleet up``, which win. Sections:

- ``scheduler``: the round's policy and the costs it weighs (``broker.scheduler.SchedulerConfig``);
- ``broker``: the control loop's timings (round interval, leader lease, heartbeats, blocklist
  decay, launch deadline, ...), the fields of ``broker.server.BrokerConfig`` a file may set;
- ``api``: tokens and request limits (``broker.auth.ApiConfig``).

Every key, its default and its meaning is listed in docs/configuration.md, generated from this
model. An unknown key or a bad value is a ``BrokerConfigError`` naming the key and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from broker.auth import ApiConfig
from broker.errors import InvalidInput
from broker.protocol import ENV_PREFIX
from broker.scheduler import SchedulerConfig
from broker.server import BrokerConfig
from broker.spec import Problem, preview

# The fields of BrokerConfig a file may set: its tuning knobs (where the broker's state lives,
# its Redis and its fleet file are ``fleet up``'s flags; its identity and tokens are its own).
BROKER_KEYS = ("tick_s", "lease_ttl_s", "lease_stall_s", "heartbeat_interval_s",
               "blocklist_decay_s", "refusal_decay_s", "quick_reclaim_s", "final_report_wait_s",
               "launch_deadline_s", "rendezvous_margin_s", "confirm_durable", "blob_retention_s")

BrokerSection = create_model(  # type: ignore[call-overload]
    "BrokerSection",
    __config__=ConfigDict(extra="forbid"),
    __doc__="The control loop's timings (``broker.server.BrokerConfig``).",
    **{k: (BrokerConfig.model_fields[k].annotation, BrokerConfig.model_fields[k])
       for k in BROKER_KEYS},
)


class BrokerConfigError(InvalidInput):
    """A broker config (file or ``FLEET_...`` variable) FleetBroker cannot use."""


class BrokerSettings(BaseSettings):
    """Everything a broker's operator may tune."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", nested_model_default_partial_update=True)

    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    broker: BrokerSection = Field(default_factory=BrokerSection)  # type: ignore[valid-type]
    api: dict[str, Any] = Field(
        default_factory=dict, description="tokens ({team|admin|agent, token|token_sha256}), "
        "max_body_bytes, max_list, blob_quota_bytes (docs/security.md)")

    @field_validator("api")
    @classmethod
    def _api(cls, v: dict[str, Any]) -> dict[str, Any]:
        ApiConfig.from_mapping(v)  # its ConfigError names the entry and the fix
        return v

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (init), then the environment, then the file
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)

    def broker_config(self, **runtime: Any) -> BrokerConfig:
        """The BrokerConfig of these settings, with ``fleet up``'s ``runtime`` fields (state
        dir, Redis URL, fleet file)."""
        return BrokerConfig(**self.broker.model_dump(), scheduler=self.scheduler, **runtime)


def load(path: Path | None = None, overrides: Mapping[str, Mapping[str, Any]] | None = None,
         ) -> BrokerSettings:
    """The settings from ``path`` (YAML; None: none), the environment and ``overrides`` (per
    section: ``{"scheduler": {"policy": "static"}}``, the flags), each over the one before."""
    if path is not None and not Path(path).is_file():
        raise BrokerConfigError(f"{path}: no such config file; pass an existing YAML file to "
                                "--config")
    cls = type("FileSettings", (BrokerSettings,), {"model_config": SettingsConfigDict(
        **{**BrokerSettings.model_config, "yaml_file": path})})
    where = str(path) if path is not None else "the broker config"
    try:
        return cls(**{k: dict(v) for k, v in (overrides or {}).items()})
    except ValidationError as exc:
        raise BrokerConfigError(f"{where}: invalid broker config (keys and defaults: "
                                "docs/configuration.md)",
                                [_problem(e) for e in exc.errors()]) from None
    except (OSError, ValueError) as exc:  # unreadable YAML, or an api entry (ConfigError)
        raise BrokerConfigError(f"{where}: {exc}") from None


def _problem(err: Mapping[str, Any]) -> Problem:
    loc = [str(x) for x in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        known = _keys(loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        env = f"{ENV_PREFIX}{'__'.join(loc).upper()}"
        return Problem(field=key, message=f"unknown key; {hint}known here: {', '.join(known)} "
                       f"(from the file, or the variable {env})")
    message = err["msg"].removeprefix("Value error, ")
    return Problem(field=key, value=preview(err.get("input")),
                   message=f"{message}; set {key} to a valid value (docs/configuration.md)")


def _keys(loc: list[str]) -> list[str]:
    """The keys a section of the settings takes (``[]``: the top level)."""
    model: type[BaseModel] = BrokerSettings
    for part in loc:
        field = model.model_fields.get(part)
        inner = getattr(field, "annotation", None) if field else None
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return []
        model = inner
    return sorted(model.model_fields)
