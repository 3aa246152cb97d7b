"""What must never leave the broker in clear: a registry of secret values (tokens, the Redis
password) and the helpers that keep them out of logs, failure reasons and the API.

``register(value)`` adds a secret (the broker registers its admin and agent tokens and the Redis
password at start); ``scrub(text)`` replaces every registered value, anything shaped like an
attempt token, bearer credentials and a URL's password with ``****``; ``reason(text)`` is
``scrub`` cut to ``MAX_REASON_CHARS`` with environment dumps dropped: what a job's recorded
failure reason (visible through the API) may hold. ``redact_url`` hides a URL's password.
"""

from __future__ import annotations

import re
import threading
import urllib.parse

MAX_REASON_CHARS = 300
MASK = "****"
_MIN_SECRET_CHARS = 8  # shorter values would mask ordinary words

_lock = threading.Lock()
_secrets: set[str] = set()

# Anything that looks like a credential whatever its origin: a 64-hex attempt token (and other
# hex digests that long), a bearer header, a URL's user:password, NAME=value where NAME says
# token, secret, password or key.
_PATTERNS = (
    (re.compile(r"\b[0-9a-fA-F]{40,}\b"), MASK),
    (re.compile(r"(?i)(bearer\s+)[^\s'\",]+"), r"\1" + MASK),
    (re.compile(r"(?i)(\b[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^@\s/]+@"), r"\1" + MASK + "@"),
    (re.compile(r"(\b[A-Z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|_KEY|CREDENTIALS?)"
                r"[A-Z0-9_]*['\"]?\s*[=:]\s*['\"]?)[^\s'\",}]+"), r"\1" + MASK),
    (re.compile(r"(?i)(\b(?:password|passwd|secret|token)['\"]?\s*[=:]\s*['\"]?)"
                r"[^\s'\",}]+"), r"\1" + MASK),
)
# An environment dump: many NAME=value (or 'NAME': 'value') pairs in one message.
_ENV_PAIR = re.compile(r"(?:\b[A-Z][A-Z0-9_]{2,}=|['\"][A-Z][A-Z0-9_]{2,}['\"]\s*:)")
_ENV_DUMP_PAIRS = 4


def register(*values: str | None) -> None:
    """Treat ``values`` as secrets from now on (empty and very short values are ignored)."""
    with _lock:
        _secrets.update(v for v in values if v and len(v) >= _MIN_SECRET_CHARS)


def registered() -> frozenset[str]:
    with _lock:
        return frozenset(_secrets)


def scrub(text: str, extra: tuple[str, ...] = ()) -> str:
    """``text`` with every registered secret (and ``extra``) and every credential-shaped
    string replaced by ``****``."""
    for value in sorted({*registered(), *(e for e in extra if e)}, key=len, reverse=True):
        if value in text:
            text = text.replace(value, MASK)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def reason(text: object, limit: int = MAX_REASON_CHARS, extra: tuple[str, ...] = ()) -> str:
    """A failure reason fit to store and show: one line, no secrets, no environment dump, at
    most ``limit`` characters."""
    raw = str(text)
    if len(raw) > 20 * limit:  # never run the patterns over a megabyte of someone's output
        raw = raw[:10 * limit] + " " + raw[-2 * limit:]
    flat = " ".join(raw.split())
    if len(_ENV_PAIR.findall(flat)) >= _ENV_DUMP_PAIRS:
        cut = _ENV_PAIR.search(flat)
        flat = flat[:cut.start() if cut else 0].rstrip(" :,({[") + " [environment omitted]"
    flat = scrub(flat, extra)
    return flat if len(flat) <= limit else flat[:limit - 1].rstrip() + "…"


def redact_url(url: str) -> str:
    """``url`` with its password (and a username's length) hidden: fit for logs and output."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return MASK
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{parts.username or ''}:{MASK}@{host}" if parts.password is not None else \
        f"{MASK}@{host}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query,
                                    parts.fragment))


