"""The client side of Kiln, outside the runtime core: the Python SDK over gRPC (Client / Session /
Generation, and AsyncClient / AsyncSession / AsyncGeneration for asyncio) and the helpers that turn text
and conversations into token ids (chat.py). The runtime only ever sees token ids; text is opt-in here.

Every failure raises a typed error of kiln.errors, re-exported below, chosen by the gRPC status."""

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

from .aio import AsyncClient, AsyncGeneration, AsyncSession
from .sync import Client, Generation, Session
from .wire import Health

__all__ = [
    "AsyncClient",
    "AsyncGeneration",
    "AsyncSession",
    "CancelledError",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "Generation",
    "Health",
    "InvalidArgumentError",
    "KilnError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "Session",
    "UnauthenticatedError",
    "UnavailableError",
]
