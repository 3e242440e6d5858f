"""The request body of `POST /v1/responses` (OpenAI's Responses API), under the rules of every OpenAI body
(kiln/server/http_models.py): a field Kiln honours is checked, any other is ignored and listed in
`Kiln-Ignored-Fields` (`include`, `reasoning`, `truncation`, `user`, `prompt_cache_key`, ...), and a field is
refused, naming it, where ignoring it would hand back something other than what the client reads:
OpenAI's built-in tools (web_search, file_search, computer use, MCP, ...: they run at OpenAI), a
`tool_choice` that names one, `background: true` (the client would poll a queued response),
`conversation` (OpenAI's Conversations API) and `prompt` (a prompt template stored at OpenAI). The
`input` items are checked by kiln/server/response_items.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidatorFunctionWrapHandler, field_validator

from kiln.engine.constraints import Constraint
from kiln.engine.sampler import INT32_MAX
from kiln.server.http_models import (
    MAX_OPENAI_TEMPERATURE,
    FunctionSpec,
    JsonObjectFormat,
    OpenAIObject,
    OpenAIRequest,
    TextFormat,
    one_message,
)
from kiln.server.service import GenerateRequest

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
REFUSED = {"background": "Kiln answers every response in the request (background: false); leave it out",
           "conversation": "Kiln keeps no OpenAI conversations: chain turns with previous_response_id",
           "prompt": "Kiln keeps no prompt templates: send instructions and input"}


class FunctionTool(FunctionSpec):
    """A function tool as the Responses API spells it: chat's function, flattened beside its type."""

    type: Literal["function"]


class FunctionChoice(OpenAIObject):
    type: Literal["function"]
    name: str


class JsonSchemaTextFormat(OpenAIObject):
    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None  # Kiln always enforces the schema


class TextConfig(OpenAIObject):
    format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")] | None = None


class ResponseBody(OpenAIRequest):
    input: str | list[Any] = []
    instructions: str | None = None  # a system message before the conversation; not carried to follow-ups
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, json_schema_extra={"maximum": INT32_MAX})
    temperature: float | None = Field(None, ge=0, le=MAX_OPENAI_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True  # false: no record is kept, and nothing can follow up on the response
    previous_response_id: str | None = Field(None, max_length=128)
    metadata: dict[str, str] | None = Field(None, max_length=16)  # kept with the response, returned as given
    background: Literal[False] | None = None
    conversation: None = None
    prompt: None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: object) -> object:
        for index, tool in enumerate(tools if isinstance(tools, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tools[{index}] is of type {kind!r}: Kiln runs function tools only (OpenAI's "
                                 "built-in tools run at OpenAI)")
        return tools

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _tool_choice_shape(cls, choice: object, handler: ValidatorFunctionWrapHandler) -> object:
        return one_message(choice, handler, 'must be "none", "auto", "required" or {"type": "function", "name": ...} '
                                            "(Kiln runs function tools only)")

    @field_validator("background", "conversation", "prompt", mode="wrap")
    @classmethod
    def _refused(cls, value: object, handler: ValidatorFunctionWrapHandler, info: Any) -> object:  # noqa: ANN401
        return one_message(value, handler, REFUSED[info.field_name])

    def generate_request(self, constraint: Constraint | None) -> GenerateRequest:
        return GenerateRequest(max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
                               constraint=constraint)

    def format_constraint(self) -> Constraint | None:
        """The constraint text.format asks for (None for text)."""
        form = self.text.format if self.text is not None else None
        if isinstance(form, JsonObjectFormat):
            return Constraint.json_object("text.format")
        if isinstance(form, JsonSchemaTextFormat):
            return Constraint.json_schema(form.schema_, "text.format.schema")
        return None
