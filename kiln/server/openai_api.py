"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /v1/models/{id}.

Every request is stateless (`RuntimeService.complete_choices`): it shares cached KV pages with any
earlier request of the same prefix, so a chat client that resends the conversation each turn recomputes
only from the first page that differs. `usage.prompt_tokens_details.cached_tokens` says how many prompt
tokens came from that cache. Unset sampling options take the server's defaults (greedy decoding,
RuntimeService.DEFAULT_MAX_TOKENS, or the chat format's), not OpenAI's. Chat is written in the server's
chat format (kiln/chat.py, `--chat-format`): a base model's transcript adds its stop rule to every reply. `model` may name the served model or one of its
aliases, be "kiln", or be left out; any other name is 404 `model_not_found`.

Beyond plain text:
- `n` choices of a prompt compute it once (forks of the first choice's sequence); with a seed, choice
  i samples with seed + i.
- `logprobs` / `top_logprobs` (chat) and `logprobs: k` (completions) report the chosen tokens' and up
  to 20 alternatives' log-probabilities, under the distribution the token was drawn from (after
  logit_bias and any grammar mask). `echo` starts a completion with its prompt.
- `response_format` (`json_object`, `json_schema`) and tool calls are enforced by grammar-constrained
  decoding (kiln/engine/constraints.py); tools, tool_choice and parallel_tool_calls follow the rules
  of kiln/tools.py, in the model's own call syntax (kiln/tool_syntax.py: Hermes `<tool_call>`, Llama 3
  JSON, Mistral `[TOOL_CALLS]`, Phi-4-mini `<|tool_call|>`), and a reply that is calls comes back as
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
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kiln.chat import TEMPLATE, ChatFormat, chat_format, from_openai_messages, knows_tools, prompt_for_chat
from kiln.engine.constraints import ANY_OBJECT, Constraint, as_generated
from kiln.engine.sampler import MAX_STOP_STRINGS
from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import InvalidArgumentError
from kiln.reasoning import ReasoningSplitter, opened_in, thinks, with_thought
from kiln.results import GenerationResult, Usage
from kiln.server.generation import Delta, SseResponse, deltas, start_all, unless_disconnected
from kiln.server.http_auth import caller, connection
from kiln.server.http_errors import ModelNotFoundError
from kiln.server.http_models import ChatBody, CompletionBody, JsonBodyRoute, NamedToolChoice, OpenAIBody
from kiln.server.service import RuntimeService, naming
from kiln.tokenizer import Tokenizer
from kiln.tool_syntax import KILN, ToolSyntax, markup_decoder, syntax_for
from kiln.tools import (
    ArgumentsDelta,
    CallStart,
    ContentDelta,
    Tool,
    ToolCallParser,
    ToolChoice,
    check_names,
    grammar,
    json_rule,
)

MODEL_ALIAS = "kiln"  # also names the served model, for clients configured once for any Kiln server
TopLogprobs = tuple[tuple[int, float], ...]
Alternatives = list[tuple[str, float]]  # a position's likeliest tokens as text, with their logprobs


@dataclass
class _ChoiceText:
    """One choice's text as the API shows it: `push` turns text that became final into pieces (a
    completion's text; a chat delta with content or tool calls), `finish` flushes what was held back.
    The same pieces build a streamed reply and a whole one."""

    chat: bool
    parser: ToolCallParser | None = None  # chat with callable tools
    prefix: str = ""  # echo: the prompt, before the first piece
    lead: str = ""  # what the chat format puts before every reply (a transcript's space): not content
    reasoning: ReasoningSplitter | None = None  # a reasoning model's chat: its thinking is reasoning_content
    syntax: ToolSyntax = KILN
    call_ids: list[str] = field(default_factory=list)

    def push(self, text: str) -> list[dict]:
        if self.prefix:
            text, self.prefix = self.prefix + text, ""
        if self.reasoning is None:
            return self._answer(text)
        thinking, text = self.reasoning.push(text)
        return ([{"reasoning_content": thinking}] if thinking else []) + self._answer(text)

    def _answer(self, text: str) -> list[dict]:
        if self.parser is None:
            return [self._text(text)] if text else []
        return [self._piece(delta) for delta in self.parser.push(text)]

    def finish(self, reason: str) -> list[dict]:
        """The pieces held back until the generation ended for `reason`."""
        pieces = self.push("")
        if self.reasoning is not None:
            thinking, text = self.reasoning.finish()
            pieces += ([{"reasoning_content": thinking}] if thinking else []) + self._answer(text)
        return pieces + ([self._piece(delta) for delta in self.parser.finish(reason == "stop")] if self.parser else [])

    def ended(self) -> bool:
        """The reply is over before the generation is: the model repeated a tool call."""
        return self.parser is not None and self.parser.repeated

    def finish_reason(self, reason: str) -> str:
        """A reply of whole calls ends with "tool_calls", even when max_tokens cut the generation while
        it was repeating one (held back, never shown) or had not yet started another."""
        complete = reason == "stop" or (reason == "length" and self.parser is not None and self.parser.calls_complete)
        return "tool_calls" if complete and self.call_ids else reason

    def _text(self, text: str) -> dict:
        if not self.chat:
            return {"text": text}
        text, self.lead = text.removeprefix(self.lead), ""
        return {"content": text}

    def _piece(self, delta: ContentDelta | CallStart | ArgumentsDelta) -> dict:
        if isinstance(delta, ContentDelta):
            return self._text(delta.text)
        if isinstance(delta, CallStart):
            self.call_ids.append(self.syntax.call_id())
            call = {"index": delta.index, "id": self.call_ids[-1], "type": "function",
                    "function": {"name": delta.name, "arguments": ""}}
        else:
            call = {"index": delta.index, "function": {"arguments": delta.text}}
        return {"tool_calls": [call]}


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


def _entry(token: str, value: float | None) -> dict:
    return {"token": token, "logprob": value, "bytes": list(token.encode())}


COMPLETION, CHAT = _Shape(), _ChatShape()


@dataclass(frozen=True)
class _Plan:
    """What one OpenAI request generates: the prompts' token ids, n choices of each, the constraint the
    text must match, and how its text reads back (tool calls, echo)."""

    prompts: list[list[int]]
    constraint: Constraint | None = None
    calls: bool = False  # the reply may be tool calls
    echoes: list[str] | None = None  # completions with echo: each prompt's text
    form: ChatFormat = TEMPLATE  # chat: the format's stop strings, default reply limit and lead end every reply
    reasoning: bool = False  # chat with a reasoning model: its thinking is reasoning_content
    thinking_opened: bool = False  # the prompt opened the thinking: the reply starts inside it


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
    plan: _Plan
    tokenizer: Tokenizer
    response_id: str
    created: int
    model: str
    streams: list[AsyncGenerationStream]  # prompt-major: choice i is prompt i // n, its (i % n)-th choice
    n: int
    stop: tuple[str, ...]
    include_usage: bool
    logprobs: bool

    syntax: ToolSyntax = KILN

    def text(self, index: int) -> _ChoiceText:
        echo = self.plan.echoes[index // self.n] if self.plan.echoes else ""
        lead = " " if self.plan.form.transcript else ""
        reasoning = ReasoningSplitter(self.plan.thinking_opened) if self.plan.reasoning else None
        parser = ToolCallParser(self.syntax) if self.plan.calls else None
        return _ChoiceText(self.shape.chat, parser, echo, lead, reasoning, self.syntax)

    def decode(self) -> Callable[[Sequence[int]], str]:
        """Token ids to the reply's text, keeping the call syntax's control tokens when it may call tools."""
        return markup_decoder(self.tokenizer, self.syntax) if self.plan.calls else self.tokenizer.decode

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
        alternatives = [[(self.tokenizer.decode([t]), v) for t, v in top] for top in tops] if tops else None
        return self.shape.logprobs(tokens, list(values), alternatives, offset)

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
        self.chat_format = chat_format(service.llm.tokenizer, chat_format_name)  # kiln/chat.py
        self.tool_syntax = syntax_for(service.llm.tokenizer)  # kiln/tool_syntax.py
        self.reasoning = not self.chat_format.transcript and thinks(service.llm.tokenizer.chat_template)
        # parallel_tool_calls unset: several calls a reply only for a model trained to call tools; one that was
        # not (told its tools in Kiln's text) repeats its call until max_tokens, so its reply ends after one
        self.parallel_calls = not self.chat_format.transcript and knows_tools(service.llm.tokenizer)

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
        self._check_model(model_id)
        return self._model_json(model_id)

    def _model_json(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "kiln",
                "max_model_len": self.service.llm.engine.max_model_len, **self.service.model_facts}

    def _check_model(self, model: str | None) -> None:
        if model not in (None, MODEL_ALIAS, self.service.model_name, *self.service.aliases):
            raise ModelNotFoundError(f"the model {model!r} does not exist here; this server serves "
                                     f"{', '.join(repr(name) for name in (self.service.model_name, *self.service.aliases))}")

    def _completion_plan(self, body: CompletionBody) -> _Plan:
        prompts = body.prompts()
        ids = [self.service.tokenize(p, True, "prompt") if isinstance(p, str) else p for p in prompts]  # with BOS
        echoes = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        return _Plan(ids, _checked(body.format_constraint()), echoes=echoes)

    def _chat_plan(self, body: ChatBody) -> _Plan:
        """Tools, tool_choice and response_format checked part by part (each error names its field),
        then the constraint the reply must match and the prompt with the callable tools rendered."""
        tools = [Tool(spec.function.name, spec.function.description or "", None if spec.function.parameters is None
                      else as_generated(spec.function.parameters, f"tools[{index}].function.parameters"))
                 for index, spec in enumerate(body.tools or ())]
        check_names(tools)
        for index, tool in enumerate(tools):
            _checked(Constraint.json_schema(tool.schema, f"tools[{index}].function.parameters"))
        choice = _tool_choice(body, tools, self.parallel_calls)
        plain = _checked(body.format_constraint())
        rules = grammar(tools, choice, _schema_of(plain), self.tool_syntax, self.tokenizer) if tools else None
        room = MAX_STOP_STRINGS - len(self.chat_format.stop)
        if len(body.stop_strings) > room:
            raise InvalidArgumentError(f"at most {room} stop strings: the {self.chat_format.name} chat format adds its "
                                       f"own {len(self.chat_format.stop)}", "stop")
        messages = from_openai_messages(body.messages)
        with naming("messages"):  # text the tokenizer refuses (a lone surrogate) came from the messages
            text, add_bos = prompt_for_chat(messages, self.tokenizer, tools if rules is not None else (), self.chat_format,
                                            body.chat_template_kwargs)
            prompt = self.tokenizer.encode(text, add_bos)
        opened = self.reasoning and opened_in(text)
        if self.reasoning and (rules is not None or plain is not None):  # it thinks first, then answers as constrained
            rules = with_thought(rules or f"start: {json_rule(_schema_of(plain))}", opened)
        constraint = plain if rules is None else Constraint.grammar(rules, "tools" if tools else "response_format")
        return _Plan([prompt], constraint, calls=bool(tools) and choice.calls_allowed, form=self.chat_format,
                     reasoning=self.reasoning, thinking_opened=opened)

    async def _reply(self, request: Request, body: OpenAIBody, shape: _Shape, plan_of: Callable[[], _Plan]) -> Response:
        """`plan_of()` checks the request, renders and tokenizes the prompts on a worker thread (megabytes
        of text, a chat template, schemas to check): the event loop keeps serving everyone else. The
        generations' streams belong to the loop; their submission runs on worker threads too."""
        self._check_model(body.model)
        plan = await run_in_threadpool(plan_of)
        # what the request leaves out, the model's generation_config.json may set (as vLLM does)
        generate = self.service.llm.loaded.generation_defaults.fill(body.generate_request(plan.constraint))
        stop = (*body.stop_strings, *plan.form.stop)  # a chat format's stop rule ends its replies
        generate = replace(generate, stop=stop, max_tokens=plan.form.max_tokens if generate.max_tokens is None
                           else generate.max_tokens)
        try:
            groups = await start_all([functools.partial(self.service.complete_choices, prompt, generate, body.n,
                                                        caller(request), connection(request))
                                      for prompt in plan.prompts])
        except InvalidArgumentError as error:  # the engine names its own fields; name the request's
            error.param = body.field_name(error.param)
            raise
        streams = [stream for group in groups for stream in group]
        reply = _Reply(shape, plan, self.tokenizer, shape.id_prefix + secrets.token_hex(12), int(time.time()),
                       body.model if body.model in self.service.aliases else self.service.model_name, streams, body.n,
                       stop, body.include_usage,
                       body.wants_logprobs, self.tool_syntax)
        if body.stream:
            return SseResponse(self._chunks(reply), streams)
        finished = await unless_disconnected(request, self._whole_choices(reply), streams)
        return JSONResponse(reply.body(finished))

    async def _whole_choices(self, reply: _Reply) -> list[_Finished]:
        """Every choice in turn, built from the same pieces its stream would send."""
        finished = []
        for index, stream in enumerate(reply.streams):
            text = reply.text(index)
            pieces: list[dict] = []
            async for delta in deltas(stream, self.tokenizer, reply.stop, text.ended, reply.decode()):
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
        async for delta in deltas(stream, self.tokenizer, reply.stop, text.ended, reply.decode()):
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


def _checked(constraint: Constraint | None) -> Constraint | None:
    """The constraint, once it is known to compile (an error names its request field)."""
    if constraint is not None:
        constraint.check()
    return constraint


def _schema_of(constraint: Constraint | None) -> dict | None:
    """The JSON schema a non-call reply must match (response_format), for the tool grammar."""
    if constraint is None:
        return None
    return ANY_OBJECT if constraint.kind == "json_object" else json.loads(constraint.source)


def _tool_choice(body: ChatBody, tools: list[Tool], parallel_default: bool) -> ToolChoice:
    """tool_choice and parallel_tool_calls (unset: `parallel_default`) as a ToolChoice; naming a
    function not in `tools`, or choosing tools when there are none, is refused."""
    parallel = parallel_default if body.parallel_tool_calls is None else body.parallel_tool_calls
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if tools else "none", parallel=parallel)
    if not tools and choice != "none":
        raise InvalidArgumentError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {tool.name for tool in tools}:
            raise InvalidArgumentError(f"tool_choice names the function {choice.function.name!r}, which is not in "
                                       "tools", "tool_choice")
        return ToolChoice("function", choice.function.name, parallel)
    return ToolChoice(choice, parallel=parallel)
