"""Request bodies of the HTTP API, as pydantic models.

Every body is strict (no string-to-number coercion). Kiln's own bodies (REST sessions, tokenize) forbid
unknown fields, so a typo is a clear 400 naming the field. OpenAI's bodies (/v1/completions,
/v1/chat/completions and the objects in them) follow what OpenAI clients assume instead, as vLLM and
llama-server do: OpenAI adds request fields often, clients send them as soon as it does
(`reasoning_effort`), and a server that refuses them breaks those clients. In an OpenAI body:
- a field Kiln honours is checked, and a bad value is a 400 naming it. Range checks of sampling values
  live in RuntimeService/SamplingParams, the one place every transport shares (except OpenAI's narrower
  temperature range, checked here); the OpenAPI document (kiln/server/openapi.py) states the same ranges
  as `json_schema_extra`, documentation only, so a generated client knows them;
- null means the field is left out (OpenAI's types make most fields nullable);
- any other field is ignored, listed in the response's `Kiln-Ignored-Fields` header (sorted, dotted
  paths: `reasoning_effort, stream_options.include_obfuscation`) and logged once per process. Among
  OpenAI's own: what describes the caller or a service around the generation, not its text (`user`,
  `store`, `metadata`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `prompt_cache_options`,
  `prompt_cache_retention`, `moderation`, `web_search_options`), hints Kiln does not take
  (`reasoning_effort`, `verbosity`, `prediction`) and `audio` (a voice, for audio Kiln never writes).
  Their names go into a header and the log, so each must be plain (IGNORABLE_NAME) and a body may have
  at most MAX_IGNORED_FIELDS;
- a field is refused, naming it, where ignoring it would hand back something other than what the client
  reads: `functions` / `function_call` (OpenAI's deprecated tools: the client waits for a
  `function_call`), `modalities` with "audio", `best_of` over `n` (ranking extra candidates away) and a
  non-empty `suffix` (a completion written to lead into it).
Chat messages are the conversation itself, not options: kiln/chat.py takes every field OpenAI's message
types define and refuses any other, so no part of a conversation is dropped unseen.

A large body (LARGE_BODY_BYTES and up, to the server's 4 MiB limit) is parsed on a worker thread by
`JsonBodyRoute`, not on the event loop every stream and probe shares. Parsing builds a Python object per
JSON value under the interpreter lock, so a worker thread alone would still hold the loop for the whole
parse: every number and object goes through a Python call, where the lock changes hands, and large
bodies are parsed one at a time, so four 4 MiB bodies cost the loop short waits, not their whole parses.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from starlette.concurrency import run_in_threadpool

from kiln.chat import OPENAI_ROLES
from kiln.engine.constraints import Constraint
from kiln.engine.sampler import (
    INT32_MAX,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_OPENAI_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    SEED_RANGE,
)
from kiln.kv.policy import POLICIES
from kiln.server.service import GenerateRequest
from kiln.sessions import MAX_TTL_S, MIN_TTL_S

LARGE_BODY_BYTES = 64 << 10  # bodies this large are parsed on a worker thread (JsonBodyRoute)
MAX_PROMPTS = 32  # prompts in one /v1/completions request
MAX_CHOICES = 16  # `n`: choices per prompt
MAX_OPENAI_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]; Kiln's own APIs allow up to 100
OPENAI_PENALTY = {"minimum": -MAX_OPENAI_PENALTY, "maximum": MAX_OPENAI_PENALTY}
IGNORED_FIELDS_HEADER = "Kiln-Ignored-Fields"
IGNORABLE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what an ignored field may be named
MAX_IGNORED_FIELDS = 64  # ignored fields in one OpenAI body, nested ones included
MAX_LOGGED_NAMES = 1024  # ignored names logged per process; later new names are listed in the header only

TokenIds = Annotated[list[int], WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": 0}})]
NUMBER_IDS = {"propertyNames": {"pattern": "^[0-9]+$"}}  # an object keyed by token ids
STOP_STRINGS = {"maxItems": MAX_STOP_STRINGS, "minLength": 1, "maxLength": MAX_STOP_LENGTH,
                "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": list(OPENAI_ROLES)}, "content": {"type": ["string", "array", "null"]}, "name": {"type": "string"},
    "tool_calls": {"type": "array"}, "tool_call_id": {"type": "string"}, "refusal": {"type": ["string", "null"]},
    "annotations": {"type": ["array", "null"]}, "reasoning_content": {"type": ["string", "null"]}}}
DEPRECATED_TOOLS = {"not": {}, "description": "refused: OpenAI's deprecated form of tools; send tools and tool_choice"}

logger = logging.getLogger(__name__)
_logged_names: set[str] = set()  # the ignored fields' names logged so far


def one_message(value: object, handler: ValidatorFunctionWrapHandler, message: str) -> Any:  # noqa: ANN401
    """A wrap validator's value, validated, or one clear error instead of one per branch of its union."""
    try:
        return handler(value)
    except ValidationError:
        raise ValueError(message) from None

class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _open_schema(schema: dict[str, Any]) -> None:
    """OpenAIObject's rule in its JSON schema: more fields of plain names, and null for any optional one."""
    schema["propertyNames"] = {"pattern": IGNORABLE_NAME.pattern}
    required = set(schema.get("required", ()))
    for name, field in schema.get("properties", {}).items():
        if name not in required and {"type": "null"} not in field.get("anyOf", ()):
            schema["properties"][name] = {"anyOf": [field, {"type": "null"}]}


class OpenAIObject(Body):
    """An object of OpenAI's API: null is a field left out, and an undeclared field is kept aside to be
    reported as ignored (the module docstring says why)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_open_schema)

    @model_validator(mode="before")
    @classmethod
    def _open_fields(cls, data: object) -> object:
        """Nulls left out; any name not declared must be plain (every declared one is)."""
        if not isinstance(data, dict):
            return data
        odd = next((name for name in data if not IGNORABLE_NAME.fullmatch(name)), None)
        if odd is not None:
            raise ValueError(f"unknown field {odd[:80]!r}: Kiln ignores unknown fields, but only those named with "
                             "up to 64 letters, digits, '_' or '-'")
        return {name: value for name, value in data.items() if value is not None}

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The dotted paths of the fields this object and those in it ignore, sorted (a list's items
        share a path: `tools.function.x`)."""
        names = {prefix + name for name in self.model_extra or {}}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, OpenAIObject):
                    names.update(item.ignored_fields(f"{prefix}{field.alias or name}."))
        return sorted(names)


class GenerateBody(Body):
    """What every generating route shares: sampling options (None = the server's default) and the
    choice of delivery (one JSON body, or server-sent events)."""

    stream: bool = False
    max_tokens: int | None = Field(None, ge=1, json_schema_extra={"maximum": INT32_MAX})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 100})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": INT32_MAX})  # Kiln extension (as in vLLM)
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})  # Kiln extension (as in vLLM)
    repetition_penalty: float | None = Field(None, json_schema_extra={  # Kiln extension (as in vLLM)
        "exclusiveMinimum": 0, "maximum": MAX_REPETITION_PENALTY})
    presence_penalty: float | None = Field(None, json_schema_extra=OPENAI_PENALTY)
    frequency_penalty: float | None = Field(None, json_schema_extra=OPENAI_PENALTY)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = Field(None, json_schema_extra=STOP_STRINGS)
    stop_token_ids: TokenIds = []  # Kiln extension (as in vLLM)
    ignore_eos: bool = False  # Kiln extension (as in vLLM)

    def generate_request(self, constraint: Constraint | None = None) -> GenerateRequest:
        return GenerateRequest(
            max_tokens=self.reply_limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_alternatives,
            logit_bias=self.bias,
            constraint=constraint,
        )

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, stop: object, handler: ValidatorFunctionWrapHandler) -> str | list[str] | None:
        return one_message(stop, handler, "must be a string or an array of strings")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


    @property
    def reply_limit(self) -> int | None:
        return self.max_tokens

    @property
    def wants_logprobs(self) -> bool:
        """Whether the reply carries the chosen tokens' log-probabilities (each body spells it its way)."""
        return False

    @property
    def top_alternatives(self) -> int:
        """How many likeliest alternatives to report per token (0: none)."""
        return 0

    def field_name(self, param: str | None) -> str | None:
        """The request field behind an engine parameter's name (they differ in a few bodies)."""
        return param

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        return ()


class StreamOptions(OpenAIObject):
    include_usage: bool = False


class TextFormat(OpenAIObject):
    type: Literal["text"]


class JsonObjectFormat(OpenAIObject):
    type: Literal["json_object"]


class JsonSchemaSpec(OpenAIObject):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None  # Kiln always enforces the schema


class JsonSchemaFormat(OpenAIObject):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class OpenAIRequest(OpenAIObject):
    """What every OpenAI request body has: the model, and at most MAX_IGNORED_FIELDS fields ignored."""

    model: str | None = None  # None = the served model; another name is NOT_FOUND

    @model_validator(mode="after")
    def _few_ignored_fields(self) -> OpenAIRequest:
        ignored = self.ignored_fields()
        if len(ignored) > MAX_IGNORED_FIELDS:
            raise ValueError(f"at most {MAX_IGNORED_FIELDS} fields Kiln ignores per request, got {len(ignored)}: "
                             f"{', '.join(ignored[:3])}, ...")
        return self


class OpenAIBody(GenerateBody, OpenAIRequest):
    """What /v1/completions and /v1/chat/completions share."""

    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_OPENAI_TEMPERATURE})
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={  # token id -> value added to its logit
        **NUMBER_IDS, "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _few_entries(cls, bias: object) -> object:
        """Counted before any entry is looked at: a huge map is refused for the price of its length."""
        if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries (OpenAI's limit), got {len(bias)}")
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias and not all(key.isdigit() for key in bias):
            raise ValueError("keys must be token ids (decimal strings)")
        return bias

    @property
    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), value) for key, value in (self.logit_bias or {}).items())

    def format_constraint(self) -> Constraint | None:
        """The constraint response_format asks for (None for text)."""
        form = self.response_format
        if isinstance(form, JsonObjectFormat):
            return Constraint.json_object("response_format")
        if isinstance(form, JsonSchemaFormat):
            return Constraint.json_schema(form.json_schema.schema_, "response_format.json_schema.schema")
        return None

    @field_validator("temperature")
    @classmethod
    def _openai_temperature(cls, temperature: float | None) -> float | None:
        if temperature is not None and temperature > MAX_OPENAI_TEMPERATURE:
            raise ValueError(f"must be at most {MAX_OPENAI_TEMPERATURE:g} (OpenAI's range), got {temperature:g}")
        return temperature

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def ignored_fields_header(body: OpenAIRequest) -> dict[str, str]:
    """The Kiln-Ignored-Fields header of the response to `body` (none when it ignores nothing). Each name
    is logged the first time a body ignores it, for the first MAX_LOGGED_NAMES names."""
    ignored = body.ignored_fields()
    for name in ignored:
        if name not in _logged_names and len(_logged_names) < MAX_LOGGED_NAMES:
            _logged_names.add(name)
            logger.warning("ignoring the request field %r, which Kiln does not take (logged once; each response "
                           "lists the fields it ignored in %s)", name, IGNORED_FIELDS_HEADER)
    return {IGNORED_FIELDS_HEADER: ", ".join(ignored)} if ignored else {}


class CompletionBody(OpenAIBody):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # the chosen token's, plus this many alternatives
    echo: bool = False  # the reply starts with the prompt
    best_of: int | None = None  # at most n: Kiln returns every choice it generates, it ranks none away
    suffix: str | None = None  # only empty: Kiln does not write a completion to lead into a suffix

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, prompt: object, handler: ValidatorFunctionWrapHandler) -> str | list:
        """At most MAX_PROMPTS prompts."""
        prompt = one_message(prompt, handler, "must be a string, an array of token ids, or an array of strings or of "
                                              "token-id arrays")
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_prompt_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs needs the prompt's log-probabilities, which Kiln does not compute; "
                             "leave out logprobs or echo")
        return echo

    @field_validator("best_of")
    @classmethod
    def _no_ranking(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of > info.data.get("n", 1):
            raise ValueError(f"best_of {best_of} > n asks to rank extra candidates away, which Kiln does not do: "
                             "leave it out or ask for n choices")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("Kiln does not write a completion to lead into a suffix (fill-in-the-middle): leave it out")
        return suffix

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_alternatives(self) -> int:
        return self.logprobs or 0

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        prompt = self.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        return list(prompt) if many else [prompt]


class FunctionSpec(OpenAIObject):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments; None: no arguments
    strict: bool | None = None  # Kiln always enforces the schema


class ToolSpec(OpenAIObject):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(OpenAIObject):
    name: str


class NamedToolChoice(OpenAIObject):
    type: Literal["function"]
    function: FunctionName


class ChatBody(OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra={"items": MESSAGE})
    max_completion_tokens: int | None = Field(None, ge=1, json_schema_extra={"maximum": INT32_MAX})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # extra variables for the model's chat template, e.g. {"enable_thinking": false} (as vLLM accepts them)
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None  # Kiln writes text only
    # OpenAI's deprecated form of tools: refused, since a client that sends them waits for a `function_call`
    functions: Annotated[Any, WithJsonSchema(DEPRECATED_TOOLS)] = None
    function_call: Annotated[Any, WithJsonSchema(DEPRECATED_TOOLS)] = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return top_logprobs

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice_shape(cls, choice: object, handler: ValidatorFunctionWrapHandler) -> object:
        return one_message(choice, handler, 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @field_validator("modalities", mode="wrap")
    @classmethod
    def _text_only(cls, modalities: object, handler: ValidatorFunctionWrapHandler) -> list[str] | None:
        return one_message(modalities, handler, 'Kiln writes text only: modalities may only be ["text"]')

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_tools(cls, value: object) -> object:
        """Runs only for a value sent (null is left out)."""
        raise ValueError("OpenAI's deprecated form of tools, which Kiln does not take: send tools and tool_choice")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def top_alternatives(self) -> int:
        return self.top_logprobs or 0

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def field_name(self, param: str | None) -> str | None:
        return "max_completion_tokens" if param == "max_tokens" and self.max_completion_tokens is not None else param


class CreateSessionBody(Body):
    token_ids: TokenIds = []
    ttl_s: float | None = Field(None, json_schema_extra={"minimum": MIN_TTL_S, "maximum": MAX_TTL_S})
    kv_policy: str | None = Field(None, json_schema_extra={"enum": [*POLICIES, None]})
    kv_sink_tokens: int | None = Field(None, json_schema_extra={"minimum": 0})
    kv_window_tokens: int | None = Field(None, json_schema_extra={"minimum": 0})


class AppendBody(Body):
    token_ids: TokenIds


class ForkBody(Body):
    at: int | None = Field(None, json_schema_extra={"minimum": 0})


class SessionGenerateBody(GenerateBody):
    logprobs: bool = False
    # at most one: the generated text must match it (this generate only; the history stays as it is)
    json_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    grammar: str | None = None  # Lark, llguidance's dialect

    def generate_request(self, constraint: Constraint | None = None) -> GenerateRequest:
        return super().generate_request(constraint or Constraint.one_of(self.json_schema, self.regex, self.grammar))

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


class TokenizeBody(Body):
    text: str
    add_special_tokens: bool = False


class DetokenizeBody(Body):
    token_ids: TokenIds
    skip_special_tokens: bool = False


class JsonBodyRoute(APIRoute):
    """A route whose large JSON body is parsed off the event loop (the module docstring says how)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            return await handle(_OffLoopJsonRequest(request.scope, request.receive))

        return handler


class _OffLoopJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            body = await self.body()
            self._parsed = json.loads(body) if len(body) < LARGE_BODY_BYTES else await run_in_threadpool(_parse_large, body)
        return self._parsed


_LARGE_PARSES = threading.Lock()  # one large body parsed at a time: the others wait without the interpreter lock


def _parse_large(body: bytes) -> Any:
    """json.loads, with a Python call per number and object: points where the interpreter lock can go
    to the event loop (the C parser keeps it from start to end)."""
    with _LARGE_PARSES:
        return json.loads(body, parse_int=_int, parse_float=_float, object_hook=_same)


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)


def _same(value: dict[str, Any]) -> dict[str, Any]:
    return value
