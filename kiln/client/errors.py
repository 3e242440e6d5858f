"""gRPC statuses as the typed errors of kiln.errors: the SDK raises the classes the runtime raises in
process, chosen by the status code's name (never by parsing messages)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TypeVar

import grpc

from kiln.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KilnError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

TYPED_ERRORS = (
    InvalidArgumentError,
    NotFoundError,
    FailedPreconditionError,
    ResourceExhaustedError,
    UnauthenticatedError,
    PermissionDeniedError,
    CancelledError,
    UnavailableError,
    DeadlineExceededError,
)
_BY_CODE: dict[str, type[KilnError]] = {error.code: error for error in TYPED_ERRORS}

S = TypeVar("S")


def error_for(code: grpc.StatusCode, details: str | None) -> KilnError:
    """The typed error of a failed call. Statuses without a class of their own (INTERNAL, ABORTED, ...) give a KilnError whose `code` names the status."""
    typed = _BY_CODE.get(code.name)
    if typed is not None:
        return typed(details or code.name)
    error = KilnError(f"{code.name}: {details}")
    error.code = code.name
    return error


@contextlib.contextmanager
def typed_errors() -> Iterator[None]:
    """Re-raises a failed gRPC call inside the block as its typed error (works around `await` too)."""
    try:
        yield
    except grpc.RpcError as error:
        raise error_for(error.code(), error.details()) from None


def check_timeout(timeout_s: float | None) -> float | None:
    """A call's deadline in seconds from now (None: none), checked before any call is made."""
    number = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool)
    if timeout_s is not None and not (number and 0 < timeout_s < math.inf):
        raise InvalidArgumentError(f"timeout_s must be a positive number of seconds or None, got {timeout_s!r}", "timeout_s")
    return timeout_s


def require_open(stub: S | None) -> S:
    """A client's stub, which is None once the client was closed: calls then raise FailedPreconditionError,
    and so do reads of the streams the close ended, rather than grpc's untyped errors (ValueError,
    UsageError, asyncio.CancelledError)."""
    if stub is None:
        raise FailedPreconditionError("the client is closed")
    return stub
