"""Between Python values and kiln.v1 messages, for both clients. Requests are built here, and anything
the wire types cannot carry is refused as InvalidArgumentError before a call is made; replies become
the runtime's own types (SessionInfo, Usage), so the in-process and remote APIs hand out the same
things."""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import TypeVar

from google.protobuf.message import Message

from kiln.errors import InvalidArgumentError
from kiln.results import SessionInfo, SnapshotInfo, Usage
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
    """The `authorization` header of an API key. A key must be printable ASCII without spaces (what a
    header value carries and the server compares): anything else is refused here, when the client is
    created, rather than failing every call as INTERNAL "invalid metadata"."""
    if api_key is None:
        return ()
    if not isinstance(api_key, str) or not api_key or not all("!" <= c <= "~" for c in api_key):
        raise InvalidArgumentError("api_key must be a non-empty string of printable ASCII without spaces")
    return (("authorization", f"Bearer {api_key}"),)


def message(cls: type[M], **values: object) -> M:
    """cls(**values); a value of the wrong type or out of the field's range raises InvalidArgumentError
    naming the field (a None leaves the field unset)."""
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        culprit = next((name for name, value in values.items() if not _fits(cls, name, value)), None)
        where = cls.DESCRIPTOR.name if culprit is None else f"{culprit}={values[culprit]!r:.80}"
        raise InvalidArgumentError(f"{where}: {error}") from None


def _fits(cls: type[Message], name: str, value: object) -> bool:
    """Whether field `name` of `cls` takes `value` (protobuf's error does not always name the field)."""
    try:
        cls(**{name: value})
    except (TypeError, ValueError):
        return False
    return True


def token_ids(ids: Iterable[int] | None) -> list[int]:
    """Any iterable of integers (a list, a NumPy array, ...) as a list. Booleans are refused rather than
    sent as 0/1 (as the runtime does in process), and so are a bare str or bytes."""
    return _items(ids, _is_token_id, "token ids must be an iterable of integers")


def _is_token_id(value: object) -> bool:
    """An int, or another Integral such as a NumPy integer (the ABC check only for those: it is slow)."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def stop_strings(stop: str | Iterable[str] | None) -> list[str]:
    """A str is one stop string; otherwise an iterable of them."""
    if isinstance(stop, str):
        return [stop]
    return _items(stop, lambda value: isinstance(value, str), "stop must be a string or an iterable of strings")


def _items(values: object, is_item: Callable[[object], bool], what: str) -> list:
    """`values` (None: none) as a list, or InvalidArgumentError saying it must be `what` when it is a bare
    str or bytes, not iterable, or holds something `is_item` refuses."""
    if values is None:
        return []
    try:
        items = None if isinstance(values, str | bytes | bytearray) else list(values)
    except TypeError:
        items = None
    if items is None or not all(map(is_item, items)):
        raise InvalidArgumentError(f"{what}, got {values!r:.80}")
    return items


def generate_request(
    session_id: str,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: str | Iterable[str] | None,
    stop_token_ids: Iterable[int],
    ignore_eos: bool,
    logprobs: bool,
    json_schema: object = None,
    regex: str | None = None,
    grammar: str | None = None,
    *,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
) -> pb.GenerateRequest:
    """The Generate request; `json_schema` may be a dict (sent as JSON text) or JSON text."""
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
        json_schema=schema_text(json_schema),
        regex=regex,
        grammar=grammar,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
    )


def schema_text(schema: object) -> str | None:
    """A JSON schema as the wire carries it: JSON text (a str is taken to be JSON text already)."""
    if schema is None or isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema)
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"json_schema must be JSON-serialisable: {error}") from None


def session_info(reply: pb.SessionInfo) -> SessionInfo:
    """Every field as sent; an unset optional field (last_saved_at: never saved) is None."""
    return SessionInfo(**{f.name: getattr(reply, f.name) if _present(reply, f.name) else None for f in fields(SessionInfo)})


def _present(reply: pb.SessionInfo, name: str) -> bool:
    field = reply.DESCRIPTOR.fields_by_name[name]
    return not field.has_presence or reply.HasField(name)


def snapshot_info(reply: pb.SnapshotInfo) -> SnapshotInfo:
    return SnapshotInfo(**{f.name: getattr(reply, f.name) for f in fields(SnapshotInfo)})


def usage(reply: pb.Usage) -> Usage:
    return Usage(**{f.name: getattr(reply, f.name) for f in fields(Usage)})


def finish_reason(reason: pb.FinishReason) -> str:
    """"stop" | "length" | "cancelled", as the runtime names them in process."""
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def health(reply: pb.HealthResponse) -> Health:
    status = pb.ServingStatus.Name(reply.status).removeprefix("SERVING_STATUS_").lower()
    return Health(status, *(getattr(reply, f.name) for f in fields(Health)[1:]))
