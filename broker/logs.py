"""How the broker's processes log: plain text or one JSON object per line (``fleet up
--log-format json``, or ``FLEET_LOG_FORMAT=json``), with every secret scrubbed.

The JSON lines (the python-json-logger library) carry ``time`` (ISO 8601, UTC), ``level``,
``logger``, ``message`` and, for an error, ``exc_info``: what log shippers (Fluent Bit, the
CloudWatch agent, Cloud Logging, Azure Monitor) parse without a pattern. Every record passes
``ScrubSecrets`` first: the message, its arguments and any traceback go through
``broker.secrets.scrub``, so a token, the Redis password or a URL's credentials never reach a
log, whichever format is chosen.
"""

from __future__ import annotations

import logging
import time
from enum import StrEnum

from pythonjsonlogger.json import JsonFormatter

from broker import secrets

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class ScrubSecrets(logging.Filter):
    """Replace the record's message and traceback by their scrubbed text (``secrets.scrub``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = secrets.scrub(record.getMessage())
        record.args = None
        if record.exc_info:
            # formatted here, scrubbed, and kept as the text formatters print instead
            record.exc_text = secrets.scrub(
                logging.Formatter().formatException(record.exc_info))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = secrets.scrub(record.exc_text)
        return True


def formatter(fmt: LogFormat) -> logging.Formatter:
    """The formatter of ``fmt``; times in UTC."""
    out = JsonFormatter("{asctime}{levelname}{name}{message}", style="{",
                        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                        datefmt="%Y-%m-%dT%H:%M:%S%z") if fmt is LogFormat.JSON \
        else logging.Formatter(TEXT_FORMAT)
    out.converter = time.gmtime
    return out


def configure(fmt: LogFormat | str = LogFormat.TEXT, level: int | str = logging.WARNING) -> None:
    """Send every logger's records (uvicorn's too: it is started without a log config of its
    own) to stderr in ``fmt``, scrubbed, from ``level`` up."""
    handler = logging.StreamHandler()
    handler.addFilter(ScrubSecrets())
    handler.setFormatter(formatter(LogFormat(fmt)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
