"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models.

Every request is stateless (`RuntimeService.complete`): it shares cached KV pages with any earlier
request of the same prefix, so a chat client that resends the conversation each turn recomputes only
from the first page that differs. `usage.prompt_tokens_details.cached_tokens` says how many prompt
tokens came from that cache. Unset sampling options take the server's defaults (greedy decoding,
RuntimeService.DEFAULT_MAX_TOKENS), not OpenAI's. `model` may name the served model, be "kiln", or be
left out; any other name is NOT_FOUND.
"""

from __future__ import annotations

import functools
import itertools
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kiln.chat import from_openai_messages, tokens_for_chat
from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import NotFoundError
from kiln.results import Usage
from kiln.server.generation import Delta, Output, SseResponse, collect, deltas, start_all, unless_disconnected
from kiln.server.http_models import ChatBody, CompletionBody, OpenAIBody
from kiln.server.service import RuntimeService
from kiln.tokenizer import Tokenizer


class _Shape:
    """How one OpenAI API spells a choice and its logprobs (completions and chat differ only here)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return self.choice(index, text, finish_reason, logprobs)

    def opening(self, index: int) -> dict | None:
        """A choice's first streamed chunk before any text, if the API has one."""
        return None

    def logprobs(self, tokens: list[str], values: list[float | None], offset: int) -> dict:
        """`tokens` are the generated tokens' text; `offset` is where the first starts in the reply."""
        offsets = list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=offset))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None, "text_offset": offsets}


class _ChatShape(_Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def logprobs(self, tokens: list[str], values: list[float | None], offset: int) -> dict:
        return {"content": [{"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}
                            for token, value in zip(tokens, values, strict=True)]}


COMPLETION, CHAT = _Shape(), _ChatShape()
MODEL_ALIAS = "kiln"  # also names the served model, for clients configured once for any Kiln server


@dataclass(frozen=True)
class _Reply:
    """The generations of one OpenAI request, and the response that describes them."""

    shape: _Shape
    tokenizer: Tokenizer
    response_id: str
    created: int
    model: str
    streams: list[AsyncGenerationStream]
    stop: tuple[str, ...]
    include_usage: bool
    logprobs: bool

    def body(self, outputs: Sequence[Output]) -> dict:
        choices = [self.shape.choice(i, output.text, output.result.finish_reason,
                                     self.logprobs_json(output.result.token_ids, output.result.logprobs or [], 0))
                   for i, output in enumerate(outputs)]
        return {"id": self.response_id, "object": self.shape.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_json([output.result.usage for output in outputs])}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        """One streamed chunk; with include_usage every chunk has `usage`, null except in the last."""
        chunk = {"id": self.response_id, "object": self.shape.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        return {**chunk, "usage": usage} if self.include_usage else chunk

    def logprobs_json(self, token_ids: Sequence[int], values: Sequence[float | None], offset: int) -> dict | None:
        """The logprobs of these generated tokens in the API's format; None unless they were asked for."""
        if not self.logprobs:
            return None
        tokens = [self.tokenizer.decode([token_id]) for token_id in token_ids]
        return self.shape.logprobs(tokens, list(values), offset)


class OpenAIRoutes:
    def __init__(self, service: RuntimeService) -> None:
        self.service = service
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Tokenizer:
        return self.service.llm.tokenizer

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/v1")
        router.add_api_route("/completions", self.completions, methods=["POST"])
        router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/models", self.models, methods=["GET"])
        return router

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        return await self._reply(request, body, COMPLETION,
                                 lambda: [self._prompt_ids(prompt) for prompt in body.prompts()])

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        return await self._reply(request, body, CHAT,
                                 lambda: [tokens_for_chat(from_openai_messages(body.messages), self.tokenizer)])

    async def models(self) -> dict:
        model = {"id": self.service.model_name, "object": "model", "created": self.created, "owned_by": "kiln",
                 "max_model_len": self.service.llm.engine.max_model_len}
        return {"object": "list", "data": [model]}

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Text prompts are encoded with the model's BOS, as the model expects a document to start."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt

    async def _reply(self, request: Request, body: OpenAIBody, shape: _Shape,
                     prompts_of: Callable[[], Sequence[list[int]]]) -> Response:
        """`prompts_of()` renders and tokenizes the prompts on a worker thread (megabytes of text, a chat
        template): the event loop keeps serving everyone else. The generations' streams belong to the loop;
        their submission runs on worker threads too."""
        if body.model not in (None, MODEL_ALIAS, self.service.model_name):
            raise NotFoundError(f"model {body.model!r} is not served here; this server serves {self.service.model_name!r}")
        prompts = await run_in_threadpool(prompts_of)
        generate = body.generate_request()
        streams = await start_all([functools.partial(self.service.complete, prompt, generate) for prompt in prompts])
        reply = _Reply(shape, self.tokenizer, shape.id_prefix + secrets.token_hex(12), int(time.time()),
                       self.service.model_name, streams, body.stop_strings, body.include_usage, body.wants_logprobs)
        if body.stream:
            return SseResponse(self._chunks(reply), streams)
        outputs = await unless_disconnected(request, self._outputs(reply), streams)
        return JSONResponse(reply.body(outputs))

    async def _outputs(self, reply: _Reply) -> list[Output]:
        return [await collect(stream, self.tokenizer, reply.stop) for stream in reply.streams]

    async def _chunks(self, reply: _Reply) -> AsyncIterator[dict]:
        """The streamed chunks of every choice in turn (all generate concurrently; later ones buffer),
        then, if asked, one chunk with the usage and no choices."""
        usages: list[Usage] = []
        for index, stream in enumerate(reply.streams):
            async for chunk in self._choice_chunks(reply, index, stream, usages):
                yield chunk
        if reply.include_usage:
            yield reply.chunk([], usage_json(usages))

    async def _choice_chunks(self, reply: _Reply, index: int, stream: AsyncGenerationStream,
                             usages: list[Usage]) -> AsyncIterator[dict]:
        """One choice's chunks: one per release of text, carrying the tokens generated since the last
        (text held back for a partial character or stop string goes out with a later chunk)."""
        opening = reply.shape.opening(index)
        if opening is not None:
            yield reply.chunk([opening])
        pending: list[Delta] = []
        offset = 0
        async for delta in deltas(stream, self.tokenizer, reply.stop):
            if delta.token_id is not None:
                pending.append(delta)
            finish = delta.result.finish_reason if delta.result else None
            if delta.text or finish:
                logprobs = reply.logprobs_json([d.token_id for d in pending], [d.logprob for d in pending], offset)
                yield reply.chunk([reply.shape.chunk_choice(index, delta.text, finish, logprobs)])
                pending, offset = [], offset + len(delta.text)
            if delta.result:
                usages.append(delta.result.usage)


def usage_json(usages: Sequence[Usage]) -> dict:
    """OpenAI's usage block over one or more generations; cached_tokens = prompt tokens whose K/V was
    reused from the prefix cache rather than computed."""
    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.generated_tokens for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.reused_tokens for u in usages)}}
