"""Request bodies of the HTTP API, as pydantic models.

Every body is strict (no string-to-number coercion) and forbids unknown fields, so a typo or an
unsupported OpenAI feature is a clear 400, never silently ignored. OpenAI fields that real clients send
are accepted when Kiln honours them; ones Kiln does not implement are accepted only at their neutral
value (n=1, zero penalties, echo=false) and refused otherwise. Range checks of sampling values live in
RuntimeService/SamplingParams, the one place every transport shares.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from kiln.engine.sampler import SEED_RANGE
from kiln.server.service import GenerateRequest

MAX_PROMPTS = 32  # prompts in one /v1/completions request

TokenIds = list[int]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class GenerateBody(Body):
    """What every generating route shares: sampling options (None = the server's default) and the
    choice of delivery (one JSON body, or server-sent events)."""

    stream: bool = False
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # Kiln extension (as in vLLM)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds = []  # Kiln extension (as in vLLM)
    ignore_eos: bool = False  # Kiln extension (as in vLLM)

    def generate_request(self) -> GenerateRequest:
        return GenerateRequest(
            max_tokens=self.reply_limit,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.wants_logprobs,
        )

    @field_validator("stop", mode="wrap")
    @classmethod
    def _stop_shape(cls, stop: object, handler: ValidatorFunctionWrapHandler) -> str | list[str] | None:
        """One clear message instead of one per union branch."""
        try:
            return handler(stop)
        except ValidationError:
            raise ValueError("must be a string or an array of strings") from None

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


class StreamOptions(Body):
    include_usage: bool = False


class OpenAIBody(GenerateBody):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None  # None = the served model; another name is NOT_FOUND
    n: int = 1
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted for compatibility; Kiln does not use it

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported; send separate requests for more choices")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, penalty: float) -> float:
        if penalty != 0:
            raise ValueError("repetition penalties are not supported; send 0 or leave it out")
        return penalty

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> OpenAIBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionBody(OpenAIBody):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False

    @field_validator("logprobs")
    @classmethod
    def _chosen_only(cls, logprobs: int | None) -> int | None:
        if logprobs:
            raise ValueError("top alternatives are not computed; send logprobs=0 for the chosen tokens' log-probabilities")
        return logprobs

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, prompt: object, handler: ValidatorFunctionWrapHandler) -> str | list:
        """One clear message instead of one per union branch; at most MAX_PROMPTS prompts."""
        try:
            prompt = handler(prompt)
        except ValidationError:
            raise ValueError("must be a string, an array of token ids, or an array of strings or of token-id arrays") from None
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not isinstance(prompt[0], int):
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each text or token ids."""
        prompt = self.prompt
        many = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
        return list(prompt) if many else [prompt]


class ChatBody(OpenAIBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("top_logprobs")
    @classmethod
    def _chosen_only(cls, top_logprobs: int | None) -> int | None:
        if top_logprobs:
            raise ValueError("top alternatives are not computed; send top_logprobs=0 or leave it out")
        return top_logprobs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CreateSessionBody(Body):
    token_ids: TokenIds = []
    ttl_s: float | None = None


class AppendBody(Body):
    token_ids: TokenIds


class ForkBody(Body):
    at: int | None = None


class SessionGenerateBody(GenerateBody):
    logprobs: bool = False

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


class TokenizeBody(Body):
    text: str
    add_special_tokens: bool = False


class DetokenizeBody(Body):
    token_ids: TokenIds
    skip_special_tokens: bool = False
