"""Job secrets sealed at rest: the values of a job's ``secret_envs`` travel from the API to the
node's environment without ever sitting in Redis, a log or an API answer in clear.

The API seals them (Fernet: AES-128-CBC with an HMAC-SHA256, from ``cryptography``) into the job's
record; the actuator opens them only to hand them to the job's launch. The key is
FLEET_SECRETS_KEY when set (several replicas share it), else made once and kept, owner-only
(0600), in the broker's state dir as ``secrets.key``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from broker import secrets
from broker.errors import FleetError
from broker.protocol import BrokerEnv
from providers.local.provider import write_private

KEY_FILE = "secrets.key"
KEY_ENV = BrokerEnv.SECRETS_KEY


class SealError(FleetError):
    """Sealed secrets that this broker's key cannot open (another key, or altered)."""


class Sealer:
    """Seals and opens a job's secret values with one key."""

    def __init__(self, key: str) -> None:
        self._fernet = Fernet(key.encode())
        secrets.register(key)

    @classmethod
    def load(cls, state_dir: Path) -> Sealer:
        """The broker's key: FLEET_SECRETS_KEY, else ``state_dir/secrets.key`` (made on first
        use, mode 0600)."""
        if key := os.environ.get(KEY_ENV, "").strip():
            return cls(key)
        path = state_dir / KEY_FILE
        if not path.exists():
            state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, Fernet.generate_key().decode())
        os.chmod(path, 0o600)
        return cls(path.read_text().strip())

    def seal(self, values: dict[str, str]) -> str:
        secrets.register(*values.values())
        return self._fernet.encrypt(json.dumps(values).encode()).decode()

    def open(self, sealed: str) -> dict[str, str]:
        try:
            values = json.loads(self._fernet.decrypt(sealed.encode()))
        except InvalidToken:
            raise SealError("the job's secrets were sealed with another key: give every broker "
                            f"replica the same {KEY_ENV}") from None
        secrets.register(*values.values())  # scrubbed from any reason a launch records
        return values
