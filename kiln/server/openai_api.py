"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}.

A request is stateless (`RuntimeService.complete_choices`): it shares cached KV pages with any earlier
request of the same prefix, so a chat client that resends the conversation each turn recomputes only from
the first page that differs. With a `Kiln-Session: NAME` header it is a turn of the caller's session of
that name instead (kiln/server/chat_sessions.py), which keeps its history across restarts and prefills
only what the session lacks. `usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were
not computed again. A sampling option a request leaves out takes the model's
generation_config.json value (kiln/models/generation_config.py, as vLLM does), else OpenAI's default for
`temperature` and `top_p` (1.0: an OpenAI client that omits them samples, as it would at OpenAI), else the
server's (the rest off; max_tokens RuntimeService.DEFAULT_MAX_TOKENS, or the chat format's). Kiln's own
APIs (REST sessions, gRPC, the SDKs) keep greedy decoding as their default. Fields Kiln does not take are
ignored and listed in the `Kiln-Ignored-Fields` response header (kiln/server/http_models.py says which
are refused instead). Chat is written in the server's chat format (kiln/chat.py, `--chat-format`): a
base model's transcript adds its stop rule to every reply. `model` may name the served model or one of
its aliases, be "kiln", or be left out; any other name is 404 `model_not_found`.

Beyond plain text:
- `n` choices of a prompt compute it once (forks of the first choice's sequence); with a seed, choice
  i samples with seed + i.
- `logprobs` / `top_logprobs` (chat) and `logprobs: k` (completions) report the chosen tokens' and up
  to 20 alternatives' log-probabilities, under the distribution the token was drawn from (after
  logit_bias and any grammar mask). `echo` starts a completion with its prompt.
- `response_format` (`json_object`, `json_schema`) and tool calls are enforced by grammar-constrained
  decoding (kiln/engine/constraints.py); tools, tool_choice and parallel_tool_calls follow the rules
  of kiln/tools.py, in the model's own call syntax (kiln/tool_syntax.py: Hermes `<tool_call>`, Llama 3
  JSON, Mistral `[TOOL_CALLS][…]` or `[TOOL_CALLS]name[ARGS]{…}`, Phi-4-mini `<|tool_call|>`), and a reply that is calls comes back as
  `tool_calls` with finish_reason `tool_calls` (streamed as tool-call deltas). parallel_tool_calls
  unset allows several calls only to a model whose template takes tools; one told its tools in
  Kiln's text gets one call, after which the grammar ends the reply. A call identical to an earlier
  one of the same reply ends the reply when its object closes (the generation is cancelled there).
  finish_reason is `tool_calls` whenever every call shown is whole, even if max_tokens cut a repeat
  or the opening of a next call; a reply cut inside a call ends with `length` and the calls written
  so far, the last one's arguments possibly not yet complete JSON, never call markup as content.
- A reasoning model (its template handles `</think>`: Qwen 3, SmolLM3, DeepSeek R1 distills) thinks
  in `<think>…</think>`: that text is `reasoning_content` (message and streamed delta, as vLLM and
  DeepSeek's API do), the rest `content`; a constrained reply may think first. `chat_template_kwargs`
  (e.g. `{"enable_thinking": false}`, as vLLM accepts it) are extra variables for the template.
"""

from __future__ import annotations

import functools
import itertools
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kiln.chat import from_openai_messages
from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import InvalidArgumentError
from kiln.results import GenerationResult, Usage
from kiln.server import chat_sessions
from kiln.server.chat_plan import ChatPlanner, ChatRequest, ChoiceText, Plan, checked, function_tools
from kiln.server.chat_sessions import NamedSessions, Turn, check_name
from kiln.server.generation import Delta, SseResponse, deltas, start_all, unless_disconnected
from kiln.server.http_auth import caller, connection
from kiln.server.http_errors import ModelNotFoundError
from kiln.server.http_models import (
    ChatBody,
    CompletionBody,
    JsonBodyRoute,
    NamedToolChoice,
    OpenAIBody,
    ignored_fields_header,
)
from kiln.server.service import GenerateRequest, RuntimeService, submitted
from kiln.tokenizer import Tokenizer

MODEL_ALIAS = "kiln"  # also names the served model, for clients configured once for any Kiln server
MASKED_LOGPROB = -9999.0  # what OpenAI and vLLM report for a token that could not be drawn
TopLogprobs = tuple[tuple[int, float], ...]
Alternatives = list[tuple[str, float]]  # a position's likeliest tokens as text, with their logprobs


def _merged(pieces: Sequence[dict], chat: bool) -> dict:
    """A whole reply from its pieces: the text, or a chat message with content and tool calls."""
    text = "".join(piece.get("content" if chat else "text", "") for piece in pieces)
    if not chat:
        return {"text": text}
    thinking = "".join(piece.get("reasoning_content", "") for piece in pieces)
    calls: dict[int, dict] = {}
    for call in (call for piece in pieces for call in piece.get("tool_calls", ())):
        if call["index"] in calls:
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        else:
            calls[call["index"]] = {key: value for key, value in call.items() if key != "index"}
    message = {"role": "assistant", "content": text if text or not calls else None}
    if thinking:
        message["reasoning_content"] = thinking
    return {**message, "tool_calls": list(calls.values())} if calls else message


class _Shape:
    """How one OpenAI API spells a choice and its logprobs (completions and chat differ only here)."""

    chat = False
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, reply: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, **reply, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, piece: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return self.choice(index, piece or {"text": ""}, finish_reason, logprobs)

    def opening(self, index: int) -> dict | None:
        """A choice's first streamed chunk before any text, if the API has one."""
        return None

    def logprobs(self, tokens: list[str], values: list[float | None], tops: list[Alternatives] | None,
                 offset: int) -> dict:
        """`tokens` are the generated tokens' text; `offset` is where the first starts in the reply."""
        offsets = list(itertools.accumulate((len(token) for token in tokens[:-1]), initial=offset))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": [dict(top) for top in tops] if tops else None,
                "text_offset": offsets}


class _ChatShape(_Shape):
    chat = True
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, reply: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "message": reply, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, piece: dict, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "delta": piece, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def logprobs(self, tokens: list[str], values: list[float | None], tops: list[Alternatives] | None,
                 offset: int) -> dict:
        alternatives = tops or [[] for _ in tokens]
        return {"content": [{**_entry(token, value), "top_logprobs": [_entry(*top) for top in tops]}
                            for token, value, tops in zip(tokens, values, alternatives, strict=True)]}


def _finite(logprob: float | None) -> float | None:
    """A token the grammar or logit_bias ruled out has logprob -inf, which JSON cannot carry."""
    return MASKED_LOGPROB if logprob == -math.inf else logprob


def _entry(token: str, value: float | None) -> dict:
    return {"token": token, "logprob": value, "bytes": list(token.encode())}


COMPLETION, CHAT = _Shape(), _ChatShape()


@dataclass(frozen=True)
class _Finished:
    """One choice of a whole reply: its pieces (as a stream would send them) and how it ended."""

    pieces: list[dict]
    finish_reason: str
    result: GenerationResult


@dataclass(frozen=True)
class _Reply:
    """The generations of one OpenAI request, and the response that describes them."""

    shape: _Shape
    plan: Plan
    tokenizer: Tokenizer
    response_id: str
    created: int
    model: str
    streams: list[AsyncGenerationStream]  # prompt-major: choice i is prompt i // n, its (i % n)-th choice
    n: int
    stop: tuple[str, ...]
    include_usage: bool
    logprobs: bool
    planner: ChatPlanner

    def text(self, index: int) -> ChoiceText:
        echo = self.plan.echoes[index // self.n] if self.plan.echoes else ""
        return self.planner.choice_text(self.plan, self.shape.chat, echo)

    def body(self, finished: Sequence[_Finished]) -> dict:
        choices = []
        for index, choice in enumerate(finished):
            result = choice.result
            logprobs = self.logprobs_json(result.token_ids, result.logprobs or [], result.top_logprobs, 0)
            choices.append(self.shape.choice(index, _merged(choice.pieces, self.shape.chat), choice.finish_reason,
                                             logprobs))
        usages = [choice.result.usage for choice in finished]
        return {"id": self.response_id, "object": self.shape.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage_json(usages)}

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        """One streamed chunk; with include_usage every chunk has `usage`, null except in the last."""
        chunk = {"id": self.response_id, "object": self.shape.chunk_object, "created": self.created,
                 "model": self.model, "choices": choices}
        return {**chunk, "usage": usage} if self.include_usage else chunk

    def logprobs_json(self, token_ids: Sequence[int], values: Sequence[float | None],
                      tops: Sequence[TopLogprobs] | None, offset: int) -> dict | None:
        """The logprobs of these generated tokens in the API's format; None unless they were asked for."""
        if not self.logprobs:
            return None
        tokens = [self.tokenizer.decode([token_id]) for token_id in token_ids]
        alternatives = [[(self.tokenizer.decode([t]), _finite(v)) for t, v in top] for top in tops] if tops else None
        return self.shape.logprobs(tokens, [_finite(value) for value in values], alternatives, offset)

    def usage_json(self, usages: Sequence[Usage]) -> dict:
        """OpenAI's usage block: each prompt counts once, whatever its number of choices; cached_tokens
        = prompt tokens whose K/V was reused from the prefix cache rather than computed."""
        firsts = usages[:: self.n]
        prompt = sum(u.prompt_tokens for u in firsts)
        completion = sum(u.generated_tokens for u in usages)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.reused_tokens for u in firsts)}}


class OpenAIRoutes:
    def __init__(self, service: RuntimeService, chat_format_name: str = "auto") -> None:
        self.service = service
        self.created = int(time.time())
        self.planner = ChatPlanner(service.llm.tokenizer, chat_format_name, service.llm.loaded.generation_defaults)
        self.named = NamedSessions(service, service.session_names)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.service.llm.tokenizer

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
        router.add_api_route("/completions", self.completions, methods=["POST"])
        router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"])
        router.add_api_route("/models", self.models, methods=["GET"])
        router.add_api_route("/models/{model_id:path}", self.model, methods=["GET"])
        return router

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        return await self._reply(request, body, COMPLETION, lambda: self._completion_plan(body))

    async def chat_completions(self, body: ChatBody, request: Request) -> Response:
        """An OpenAI chat completion. The conversation is written in the server's chat format (`--chat-format`):
        the model's chat template, or for a base model a User:/Assistant: transcript whose replies stop where
        the model opens the next User: turn (default max_tokens 128). A reply is complete when finish_reason is
        `stop` or `tool_calls`. With `length` (max_tokens cut it) the content is a prefix of a valid reply (of
        the response_format's JSON too) and `tool_calls` holds the calls written so far, the last one's
        arguments possibly incomplete JSON; call markup never appears in content. A call identical to an
        earlier call of the same reply ends the reply before it (`tool_calls`)."""
        return await self._reply(request, body, CHAT, lambda: self._chat_plan(body))

    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_json(name) for name in (self.service.model_name, *self.service.aliases)]}

    async def model(self, model_id: str) -> dict:
        self.check_model(model_id)
        return self._model_json(model_id)

    def _model_json(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kiln",
                "max_model_len": self.service.llm.engine.max_model_len, **self.service.model_facts}

    def served_model(self, model: str | None) -> str:
        """The name a reply gives the model: the alias the request used, else the served model's id."""
        return model if model in self.service.aliases else self.service.model_name

    def check_model(self, model: str | None) -> None:
        """ModelNotFoundError unless `model` names the served model, one of its aliases or "kiln" (None: it)."""
        if model not in (None, MODEL_ALIAS, self.service.model_name, *self.service.aliases):
            raise ModelNotFoundError(f"the model {model!r} does not exist here; this server serves "
                                     f"{', '.join(repr(name) for name in (self.service.model_name, *self.service.aliases))}")

    def _completion_plan(self, body: CompletionBody) -> Plan:
        prompts = body.prompts()
        ids = [self.service.tokenize(p, True, "prompt") if isinstance(p, str) else p for p in prompts]  # with BOS
        echoes = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        sources = [(p, True) if isinstance(p, str) else (p, False) for p in prompts]
        return Plan(ids, sources, checked(body.format_constraint()), echoes=echoes)

    def _chat_plan(self, body: ChatBody) -> Plan:
        """Tools, tool_choice and response_format checked part by part (each error names its field),
        then the constraint the reply must match and the prompt with the callable tools rendered."""
        tools = function_tools([spec.function for spec in body.tools or ()], "tools[{index}].function.parameters")
        choice = body.tool_choice
        named = isinstance(choice, NamedToolChoice)
        return self.planner.plan(ChatRequest(
            from_openai_messages(body.messages), tools, "function" if named else choice,
            choice.function.name if named else None, body.parallel_tool_calls, body.format_constraint(),
            body.stop_strings, body.chat_template_kwargs))

    async def _reply(self, request: Request, body: OpenAIBody, shape: _Shape, plan_of: Callable[[], Plan]) -> Response:
        """`plan_of()` checks the request, renders and tokenizes the prompts on a worker thread (megabytes
        of text, a chat template, schemas to check): the event loop keeps serving everyone else. The
        generations' streams belong to the loop; their submission runs on worker threads too."""
        self.check_model(body.model)
        plan = await run_in_threadpool(plan_of)
        generate = self.planner.sampling(body.generate_request(plan.constraint), plan, body.stop_strings)
        name = request.headers.get(chat_sessions.HEADER)
        headers = ignored_fields_header(body)
        try:
            if name is None:
                groups = await start_all([functools.partial(self.service.complete_choices, prompt, generate, body.n,
                                                            caller(request), connection(request))
                                          for prompt in plan.prompts])
                streams = [stream for group in groups for stream in group]
            else:
                turn, stream = await self._named_turn(request, check_name(name), body, plan, generate)
                streams = [stream]
                headers |= {chat_sessions.ID_HEADER: turn.session_id, chat_sessions.RECOMPUTED_HEADER: turn.reason}
        except InvalidArgumentError as error:  # the engine names its own fields; name the request's
            error.param = body.field_name(error.param)
            raise
        reply = _Reply(shape, plan, self.tokenizer, shape.id_prefix + secrets.token_hex(12), int(time.time()),
                       self.served_model(body.model), streams, body.n,
                       generate.stop, body.include_usage, body.wants_logprobs, self.planner)
        if body.stream:
            response: Response = SseResponse(self._chunks(reply), streams)
        else:
            response = JSONResponse(reply.body(await unless_disconnected(request, self._whole_choices(reply), streams)))
        response.headers.update(headers)
        return response

    async def _named_turn(self, request: Request, name: str, body: OpenAIBody, plan: Plan,
                          generate: GenerateRequest) -> tuple[Turn, AsyncGenerationStream]:
        """The request's generation in the caller's session of that name (kiln/server/chat_sessions.py):
        one turn of a name at a time, its history brought to hold the prompt, then its generate queued."""
        if body.n != 1 or len(plan.prompts) != 1:
            raise InvalidArgumentError(f"a request with the {chat_sessions.HEADER.title()} header generates one "
                                       "choice of one prompt", "n" if body.n != 1 else "prompt")
        owner, (prompt, add_bos) = caller(request), plan.sources[0]
        async with self.named.lock(owner, name):
            turn = await submitted([], lambda: self.named.prepare(owner, name, prompt, add_bos), self.service.session_threads)
            return turn, await self.service.generate(owner, turn.session_id, generate, connection(request))

    async def _whole_choices(self, reply: _Reply) -> list[_Finished]:
        """Every choice in turn, built from the same pieces its stream would send."""
        finished = []
        for index, stream in enumerate(reply.streams):
            text = reply.text(index)
            pieces: list[dict] = []
            async for delta in deltas(stream, self.tokenizer, reply.stop, text.ended, self.planner.decoder(reply.plan)):
                pieces += text.push(delta.text)
                if delta.result:
                    pieces += text.finish(delta.result.finish_reason)
                    finished.append(_Finished(pieces, text.finish_reason(delta.result.finish_reason), delta.result))
        return finished

    async def _chunks(self, reply: _Reply) -> AsyncIterator[dict]:
        """The streamed chunks of every choice in turn (all generate concurrently; later ones buffer),
        then, if asked, one chunk with the usage and no choices."""
        usages: list[Usage] = []
        for index, stream in enumerate(reply.streams):
            async for chunk in self._choice_chunks(reply, index, stream, usages):
                yield chunk
        if reply.include_usage:
            yield reply.chunk([], reply.usage_json(usages))

    async def _choice_chunks(self, reply: _Reply, index: int, stream: AsyncGenerationStream,
                             usages: list[Usage]) -> AsyncIterator[dict]:
        """One choice's chunks: one per piece of text that became final, the first of them carrying the
        tokens generated since the last chunk (text held back for a partial character, a stop string or
        a tool call's closing marker goes out with a later chunk)."""
        opening = reply.shape.opening(index)
        if opening is not None:
            yield reply.chunk([opening])
        text = reply.text(index)
        pending: list[Delta] = []
        offset = 0
        async for delta in deltas(stream, self.tokenizer, reply.stop, text.ended, self.planner.decoder(reply.plan)):
            if delta.token_id is not None:
                pending.append(delta)
            pieces = text.push(delta.text)
            finish = None
            if delta.result:
                pieces += text.finish(delta.result.finish_reason)
                finish = text.finish_reason(delta.result.finish_reason)
                usages.append(delta.result.usage)
            for number, piece in enumerate(pieces or ([{}] if finish else [])):
                logprobs = reply.logprobs_json([d.token_id for d in pending], [d.logprob for d in pending],
                                               [d.top_logprobs for d in pending if d.top_logprobs], offset)
                last = number == max(len(pieces), 1) - 1
                yield reply.chunk([reply.shape.chunk_choice(index, piece, finish if last else None, logprobs)])
                offset += len(piece.get("text", ""))
                pending = []

