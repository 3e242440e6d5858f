"""Typed errors. Each maps to one gRPC status code (and the matching HTTP/OpenAI error); the server and
SDKs translate by `code`, never by parsing messages."""

from __future__ import annotations

import uuid


class KilnError(Exception):
    code = "UNKNOWN"


class InvalidArgumentError(KilnError, ValueError):
    """Bad token ids, bad parameters, malformed or unsupported input files. `param` names the request
    field at fault when there is one (the OpenAI error envelope reports it)."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFoundError(KilnError, LookupError):
    """Unknown, closed or evicted session."""

    code = "NOT_FOUND"


class FailedPreconditionError(KilnError):
    """The call is valid but the target is not in a state to take it (e.g. an append while a generate runs)."""

    code = "FAILED_PRECONDITION"


class LeaseHeldError(FailedPreconditionError):
    """Another holder's lease on the name is live: it is owned elsewhere until `expires_at` (time.time()
    seconds) unless that holder renews or releases it."""

    def __init__(self, message: str, holder: str, expires_at: float) -> None:
        super().__init__(message)
        self.holder = holder
        self.expires_at = expires_at


class LeaseLostError(FailedPreconditionError):
    """A lease this caller held lapsed or was granted to another holder: what it fenced was refused."""


class ResourceExhaustedError(KilnError):
    """KV capacity (or another bounded resource) cannot fit the request even after eviction."""

    code = "RESOURCE_EXHAUSTED"


class CancelledError(KilnError):
    code = "CANCELLED"


class DeadlineExceededError(KilnError):
    """The call's deadline (the SDKs' `timeout_s`) passed before it completed; a generation it carried
    was cancelled on the server, keeping the tokens it had committed, as any cancel does."""

    code = "DEADLINE_EXCEEDED"


class UnauthenticatedError(KilnError):
    """No API key, or one the server does not know."""

    code = "UNAUTHENTICATED"


class PermissionDeniedError(KilnError):
    code = "PERMISSION_DENIED"


class UnavailableError(KilnError):
    """The server cannot take the call now (unreachable, or shutting down); retrying later may work."""

    code = "UNAVAILABLE"


class InvariantViolation(FailedPreconditionError):
    """A cache invariant broke: a bug in Kiln. Carries a bug id to quote in a report; only the affected
    session fails, and the violation is counted by kind."""

    def __init__(self, kind: str, detail: str) -> None:
        self.kind = kind
        self.bug_id = f"KILN-{kind.upper()}-{uuid.uuid4().hex[:8]}"
        super().__init__(f"cache invariant {kind} violated ({self.bug_id}): {detail}")
