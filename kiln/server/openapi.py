"""The HTTP API's OpenAPI document, served at `/openapi.json` behind the same authentication as the API.

FastAPI derives the request side from the routes' bodies (kiln/server/http_models.py). This module
adds what FastAPI cannot know from handlers that return plain dicts: the schema of every success
response (documentation only: handlers are not re-validated through them, which would cost a copy of
every token list), the error envelope every failure leaves as (kiln/server/http_errors.py: 4XX, and
503 while shutting down; no 422, since validation errors are 400), the bearer-key security scheme
(open on `/healthz`, `/health` and `/metrics`), operation ids named after the handlers, and OpenAPI
links from the calls that create a session, a snapshot or a response to the calls on it, so a stateful
client (schemathesis) can chain create -> append -> generate -> fork -> snapshot -> restore -> close.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, TypeAdapter

from kiln.results import SessionInfo, SnapshotInfo, Usage

REF = "#/components/schemas/{model}"
# kiln/server/http_auth.py OPEN_PATHS
OPEN_OPERATIONS = frozenset({"healthz", "healthz_head", "health", "health_head", "prometheus"})
SSE = "text/event-stream"
SSE_EVENT = {"type": "object", "required": ["data"],  # each event: a JSON chunk as text, the last `[DONE]`
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(Response):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(Response):
    error: ErrorDetail


class SessionList(Response):
    object: Literal["list"]
    data: list[SessionInfo]


class SnapshotList(Response):
    object: Literal["list"]
    data: list[SnapshotInfo]


class SessionClosed(Response):
    session_id: str
    deleted: bool


class SnapshotDeleted(Response):
    snapshot_id: str
    deleted: bool


class History(Response):
    session_id: str
    token_ids: list[int]


class SessionGenerateResult(Response):
    session_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float | None] | None
    finish_reason: Literal["stop", "length", "cancelled"]
    stop_string: str | None
    usage: Usage


class Tokens(Response):
    token_ids: list[int]


class Text(Response):
    text: str


class Model(Response):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    # The facts `kiln models` lists (kiln/models/facts.py); absent when the files can no longer be read.
    architecture: str | None = None
    parameters: int | None = None
    weight_type: str | None = None
    context_length: int | None = None
    chat_template: bool | None = None
    size_bytes: int | None = None


class ModelList(Response):
    object: Literal["list"]
    data: list[Model]


class PromptTokensDetails(Response):
    cached_tokens: int


class OpenAIUsage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Choice(BaseModel):
    """A choice's fields every reply has; text / message and logprobs vary with the request."""

    index: int
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"]
    logprobs: dict[str, Any] | None


class CompletionChoice(Choice):
    text: str


class ChatMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(Choice):
    message: ChatMessage


class Completion(Response):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: OpenAIUsage


class ChatCompletion(Response):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: OpenAIUsage


class ResponseUsage(Response):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens, cache_write_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(Response):
    """A response of the Responses API (kiln/server/responses_api.py); `output` holds message,
    function_call and reasoning items as OpenAI's API writes them."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete"]
    background: bool
    error: None
    incomplete_details: dict[str, str] | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: dict[str, Any]
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    usage: ResponseUsage | None
    metadata: dict[str, str]


class ResponseDeleted(Response):
    id: str
    object: Literal["response"]
    deleted: bool


class InputItemList(Response):
    object: Literal["list"]
    data: list[dict[str, Any]]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Health(Response):
    status: Literal["serving", "shutting_down", "engine_failed"]
    model: str
    vocab_size: int
    max_model_len: int
    sessions: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_pages_free: int


SESSION_ID = {"session_id": "$response.body#/session_id"}
SNAPSHOT_ID = {"snapshot_id": "$response.body#/snapshot_id"}
RESPONSE_ID = {"response_id": "$response.body#/id"}
SESSION_CALLS = ("info", "close", "history", "append", "generate", "fork", "snapshot")
RESPONSE_CALLS = ("get_response", "delete_response", "list_input_items")
SNAPSHOT_CALLS = ("snapshot_info", "delete_snapshot", "restore")

# operation id (the handler's name) -> its success body
RESPONSES: dict[str, type] = {
    "completions": Completion, "chat_completions": ChatCompletion, "models": ModelList, "model": Model,
    "create": SessionInfo, "list_sessions": SessionList, "info": SessionInfo, "close": SessionClosed,
    "history": History, "append": SessionInfo, "generate": SessionGenerateResult, "fork": SessionInfo,
    "snapshot": SnapshotInfo, "list_snapshots": SnapshotList, "snapshot_info": SnapshotInfo,
    "delete_snapshot": SnapshotDeleted, "restore": SessionInfo, "tokenize": Tokens, "detokenize": Text,
    "healthz": Health, "healthz_head": Health, "health": Health, "health_head": Health,
    "create_response": ResponseObject, "get_response": ResponseObject, "delete_response": ResponseDeleted,
    "list_input_items": InputItemList,
}
# with stream=true: server-sent events
STREAMED = frozenset({"completions", "chat_completions", "generate", "create_response"})
LINKS: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {  # operation -> (parameters, operations it links to)
    "create": (SESSION_ID, SESSION_CALLS), "fork": (SESSION_ID, SESSION_CALLS),
    "restore": (SESSION_ID, SESSION_CALLS), "snapshot": (SNAPSHOT_ID, SNAPSHOT_CALLS),
    "create_response": (RESPONSE_ID, RESPONSE_CALLS),
}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """The document (built once, then cached on the app as FastAPI does)."""
    if app.openapi_schema is None:
        with warnings.catch_warnings():  # GET and HEAD of a path share a handler: _describe tells them apart
            warnings.filterwarnings("ignore", "Duplicate Operation ID")
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        schemas.update(_response_schemas())
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}]
        for method, operation in _operations(document):
            _describe(method, operation)
        app.openapi_schema = document
    return app.openapi_schema


def _response_schemas() -> dict[str, Any]:
    types = (ErrorEnvelope, *dict.fromkeys(RESPONSES.values()))
    return TypeAdapter(tuple[types]).json_schema(ref_template=REF, mode="serialization")["$defs"]


def _operations(document: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(method, operation) for item in document["paths"].values() for method, operation in item.items()]


def _describe(method: str, operation: dict[str, Any]) -> None:
    """Responses, links and security of one operation, whose id FastAPI made from its handler's name."""
    name = operation["operationId"] = operation["operationId"] + ("_head" if method == "head" else "")
    responses = operation["responses"]
    responses.pop("422", None)
    success = next(status for status in responses if status.startswith("2"))
    if name == "prometheus":
        responses[success]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    if name in RESPONSES:
        content = {"application/json": {"schema": {"$ref": REF.format(model=_schema_name(RESPONSES[name]))}}}
        if name in STREAMED:
            content[SSE] = {"schema": SSE_EVENT}
        responses[success]["content"] = content
    if name in LINKS:
        parameters, targets = LINKS[name]
        responses[success]["links"] = {target: {"operationId": target, "parameters": parameters} for target in targets}
    error = {"description": "an error envelope (kiln/server/http_errors.py)",
             "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorEnvelope")}}}}
    responses.update({"4XX": error, "503": error})
    if name in OPEN_OPERATIONS:
        operation["security"] = []


def _schema_name(kind: type) -> str:
    return kind.__name__
