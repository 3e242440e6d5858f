"""Between Python values and kiln.v1 messages, for both clients. Requests are built here, and anything
the wire types cannot carry is refused as InvalidArgumentError before a call is made; replies become
the runtime's own types (SessionInfo, Usage), so the in-process and remote APIs hand out the same
things."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from google.protobuf.message import Message

from kiln.errors import InvalidArgumentError
from kiln.results import SessionInfo, Usage
from kiln.v1 import runtime_pb2 as pb

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class Health:
    """What the server serves and how full its KV cache is (see HealthResponse in the proto)."""

    status: str  # "serving" | "shutting_down" | "engine_failed"
    model: str
    vocab_size: int  # token ids are valid in [0, vocab_size)
    max_model_len: int
    sessions: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_pages_free: int


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def message(cls: type[M], **values: object) -> M:
    """cls(**values); a value of the wrong type or out of the field's range raises InvalidArgumentError
    (a None leaves the field unset)."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{cls.DESCRIPTOR.name}: {error}") from None


def token_ids(ids: Iterable[int] | None) -> list[int]:
    """Ids as a list; booleans are refused rather than sent as 0/1 (as the runtime does in process)."""
    ids = list(ids or ())
    if any(isinstance(t, bool) for t in ids):
        raise InvalidArgumentError(f"token ids must be integers, got {ids[:5]!r}")
    return ids


def stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or ())


def generate_request(
    session_id: str,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: str | Sequence[str] | None,
    stop_token_ids: Iterable[int],
    ignore_eos: bool,
    logprobs: bool,
) -> pb.GenerateRequest:
    return message(
        pb.GenerateRequest,
        session_id=session_id,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=stop_strings(stop),
        stop_token_ids=token_ids(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
    )


def session_info(reply: pb.SessionInfo) -> SessionInfo:
    return SessionInfo(**{f.name: getattr(reply, f.name) for f in fields(SessionInfo)})


def usage(reply: pb.Usage) -> Usage:
    return Usage(**{f.name: getattr(reply, f.name) for f in fields(Usage)})


def finish_reason(reason: pb.FinishReason) -> str:
    """"stop" | "length" | "cancelled", as the runtime names them in process."""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def health(reply: pb.HealthResponse) -> Health:
    status = pb.ServingStatus.Name(reply.status).removeprefix("SERVING_STATUS_").lower()
    return Health(status, *(getattr(reply, f.name) for f in fields(Health)[1:]))
