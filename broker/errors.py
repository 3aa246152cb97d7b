"""FleetBroker's errors: one hierarchy under ``FleetError``, each class with its HTTP status (the
API's one exception handler) and its CLI exit code (the CLI's one handler).

=====================  ======  =====  =============================================
class                  status  exit   what
=====================  ======  =====  =============================================
FleetError             500     1      anything else the broker refuses
InvalidInput           422     2      a spec, a flag, a file or a body to fix
PayloadTooLarge        413     2      a request body over the broker's limit
UnsupportedMedia       415     2      a body whose type is not a job spec
NotFound               404     3      no such job, team or region (for this token)
Unauthenticated        401     4      no token, or one the broker does not know
Forbidden              403     4      the token may not do this
Conflict               409     6      the record is not in a state that allows it
Unavailable            503     5      the state store or the broker cannot answer now
ProviderFailure        502     7      a cloud or backend refused or failed
=====================  ======  =====  =============================================

Modules keep their own names for their errors (``SpecError``, ``JobNotFound``,
``providers.base.ProviderError``...) as subclasses of these. ``policies`` is pure and imports
nothing of the broker: its errors are mapped here (``foreign``). Standard library only (the map
is read on first use), so the node agent raises them too.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar


class FleetError(Exception):
    """The root: a message that says what went wrong and how to fix it; ``problems``: for bad
    input, one entry per field (``broker.spec.Problem``); ``headers``: for the HTTP answer."""

    status: ClassVar[int] = 500
    exit_code: ClassVar[int] = 1

    def __init__(self, message: str = "", problems: list[Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])
        self.headers = headers

    @property
    def message(self) -> str:
        """What the API answers and the CLI prints (subclasses may shorten ``str``)."""
        return str(self)


class InvalidInput(FleetError, ValueError):
    """Bad input: the message (and ``problems``) name each field at fault and the fix."""

    status = 422
    exit_code = 2


class PayloadTooLarge(InvalidInput):
    status = 413


class UnsupportedMedia(InvalidInput):
    status = 415


class NotFound(FleetError, LookupError):
    status = 404
    exit_code = 3


class Unauthenticated(FleetError):
    status = 401
    exit_code = 4


class Forbidden(FleetError):
    status = 403
    exit_code = 4


class Conflict(FleetError):
    status = 409
    exit_code = 6


class Unavailable(FleetError):
    """The broker or its state store cannot answer now; worth a retry later."""

    status = 503
    exit_code = 5


class ProviderFailure(FleetError):
    status = 502
    exit_code = 7


@functools.cache
def foreign() -> dict[type[BaseException], type[FleetError]]:
    """Errors of packages that must not import the broker (``policies``), and the class each
    counts as."""
    from policies.elastic_dp import InfeasibleAllocation
    from policies.models import SpecFieldError, UnknownAccelerator

    return {InfeasibleAllocation: InvalidInput, UnknownAccelerator: InvalidInput,
            SpecFieldError: InvalidInput}


def kind(exc: BaseException) -> type[FleetError]:
    """The FleetError class that decides ``exc``'s status and exit code."""
    if isinstance(exc, FleetError):
        return type(exc)
    for cls, mapped in foreign().items():
        if isinstance(exc, cls):
            return mapped
    return FleetError


def as_fleet_error(exc: BaseException) -> FleetError:
    """``exc`` itself, or a mapped error (``foreign``) as the FleetError it counts as."""
    return exc if isinstance(exc, FleetError) else kind(exc)(str(exc))


def status_of(exc: BaseException) -> int:
    return kind(exc).status


def exit_code_of(exc: BaseException) -> int:
    return kind(exc).exit_code


# The statuses the client turns back into errors; any other 4xx counts as bad input, 5xx as
# unavailable (the broker answers them with a message of its own).
_BY_STATUS: dict[int, type[FleetError]] = {
    cls.status: cls for cls in (InvalidInput, PayloadTooLarge, UnsupportedMedia, NotFound,
                                Unauthenticated, Forbidden, Conflict, Unavailable)}


def for_status(status: int) -> type[FleetError]:
    """The error class of an HTTP answer's status (the client's side of the mapping)."""
    return _BY_STATUS.get(status, Unavailable if status >= 500 else InvalidInput)


def handled() -> tuple[type[BaseException], ...]:
    """Every class the API's and the CLI's one handler take: FleetError and the mapped ones."""
    return (FleetError, *foreign())
