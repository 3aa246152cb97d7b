"""API settings: token grants from the broker config and env, hashing, and clear config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import config as broker_config
from broker.auth import ApiConfig, ConfigError, Principal, Role, hash_token, new_token

TOKEN = "s3cret-token-0123456789"


def test_grants_from_config_and_env(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.yaml"
    cfg.write_text(f"api:\n  tokens:\n    - {{team: ml, token_sha256: {hash_token(TOKEN)}}}\n"
                   "  max_body_bytes: 10000\n")
    env = {"FLEET_ADMIN_TOKEN": "admin-token-0123456789",
           "FLEET_TEAM_TOKENS": "vision=vision-token-012345, nlp=nlp-token-0123456789"}
    config = ApiConfig.load(broker_config.load(cfg).api, env)
    assert config.max_body_bytes == 10000
    assert config.authenticate(TOKEN) == Principal(role=Role.TEAM, team="ml")
    assert config.authenticate("admin-token-0123456789") == Principal(role=Role.ADMIN)
    assert config.authenticate("nlp-token-0123456789") == Principal(role=Role.TEAM, team="nlp")
    assert config.authenticate("nope") is None and config.authenticate(None) is None
    assert TOKEN not in config.model_dump_json()  # only hashes are kept


def test_with_token_and_new_token() -> None:
    token = new_token()
    config = ApiConfig().with_token(token, Role.AGENT)
    assert len(token) >= 32 and config.authenticate(token) == Principal(role=Role.AGENT)


@pytest.mark.parametrize(("api", "message"), [
    ({"tokens": [{"team": "ml"}]}, "give token"),
    ({"tokens": [{"team": "ml", "token": "short"}]}, "at least 16"),
    ({"tokens": [{"team": "ML/x", "token": TOKEN}]}, "team 'ML/x' is invalid"),
    ({"tokens": [{"admin": True, "team": "ml", "token": TOKEN}]}, "exactly one of"),
    ({"tokens": [{"team": "ml", "token_sha256": "abc"}]}, "64-hex-digit"),
    ({"tokens": [{"team": "ml", "token": TOKEN, "role": "x"}]}, "unknown key 'role'"),
    ({"tokens": "x"}, "write a list"),
    ({"max_body_bytes": 1}, "api.max_body_bytes"),
    ({"port": 1}, "api.port"),
])
def test_config_errors_name_the_entry(api: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ApiConfig.from_mapping(api)


def test_env_errors() -> None:
    with pytest.raises(ConfigError, match="team=token"):
        ApiConfig.from_env({"FLEET_TEAM_TOKENS": "justatoken"})
    with pytest.raises(ConfigError, match="FLEET_ADMIN_TOKEN"):
        ApiConfig.from_env({"FLEET_ADMIN_TOKEN": "short"})
