"""OpenAI's Responses API on durable sessions:

    POST   /v1/responses                      a response (JSON, or with stream=true typed server-sent events)
    GET    /v1/responses/{id}                 a stored response
    DELETE /v1/responses/{id}                 {"id", "object": "response", "deleted": true}
    GET    /v1/responses/{id}/input_items     the input items it consumed (a list, newest first)

A response's conversation is its `instructions` (a system message; never carried to a follow-up, as at
OpenAI), the items of the responses it follows (`previous_response_id`, walked back to the first: their
input and output) and its own `input` (kiln/server/response_items.py), written in the server's chat format
with its function tools, tool_choice and `text.format` made one grammar (kiln/server/chat_plan.py, as chat
completions do). The reply's text becomes output items: a reasoning model's thinking a `reasoning` item,
text a `message`, calls `function_call` items (kiln/server/response_output.py).

A stored response (`store`, the default) is a point in a Kiln session (kiln/server/stored_responses.py).
A response without previous_response_id starts a new session (the key's `max_sessions` quota applies). A
follow-up continues its previous response's session: in place when the session's history ends there, in a
fork at that point otherwise (a second follow-up of one response, or a rendering that changed), so two
follow-ups of one response each get their own branch, sharing its pages. Only the new input is prefilled
(chat_sessions.continued keeps what the rendered conversation reproduces, the previous replies as the
model wrote them included); the reply joins the history as a generated segment. Turns that start from one
session run their preparation one at a time (TurnLocks), each after the session's previous generate ended.
A response whose session is gone (closed, or lost without persistence) is rebuilt in a new session from
its conversation: recomputed, nothing lost. Sessions survive restarts, snapshots and a fleet as every
session does; so do the records. Responses carry `Kiln-Session-Id` and `Kiln-Session-Recomputed` headers.

`store: false` keeps nothing: the turn is a stateless generation, which shares cached KV pages with any
earlier request of the same prefix (its previous response's session pages included), and nothing can
follow up on it (a follow-up naming it is 404, as at OpenAI).

usage: input_tokens (the whole conversation), input_tokens_details.cached_tokens (those not computed again:
kept in the session, or taken from the prefix cache), cache_write_tokens (those computed, now cached),
output_tokens, output_tokens_details.reasoning_tokens (the thinking's length in tokens). status is
"incomplete" (incomplete_details.reason "max_output_tokens") when the token limit cut the reply, else
"completed". A stream numbers every event (`sequence_number`); an error after the stream began is an
`error` event, and the response is not stored.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from kiln.engine.stream import AsyncGenerationStream
from kiln.errors import InvalidArgumentError, NotFoundError
from kiln.results import GenerationResult
from kiln.server import chat_sessions
from kiln.server.chat_plan import ChatRequest, Plan, function_tools
from kiln.server.chat_sessions import GENERATED, Segment, Turn, TurnLocks, continued, started
from kiln.server.generation import SseResponse, deltas, unless_disconnected
from kiln.server.http_auth import caller, connection
from kiln.server.http_models import JsonBodyRoute, JsonObjectFormat, ignored_fields_header
from kiln.server.openai_api import OpenAIRoutes
from kiln.server.response_body import FunctionChoice, JsonSchemaTextFormat, ResponseBody
from kiln.server.response_items import Item, conversation, input_items
from kiln.server.response_output import ResponseOutput
from kiln.server.service import GenerateRequest, submitted
from kiln.server.stored_responses import ResponseBook, StoredResponse


@dataclass
class _Responding:
    """One response being made: the request, its conversation and plan, where it generates, and the
    numbering of the events it sends."""

    body: ResponseBody
    owner: str | None
    response_id: str
    created_at: int
    model: str
    items: list[Item]  # its new input, canonical
    plan: Plan
    previous: StoredResponse | None  # the response it follows
    generate: GenerateRequest | None = None
    stream: AsyncGenerationStream | None = None
    turn: Turn | None = None  # the session it generates in (None: store=false, stateless)
    numbers: itertools.count = field(default_factory=itertools.count)

    def event(self, event: dict) -> dict:
        return {**event, "sequence_number": next(self.numbers)}


class ResponsesRoutes:
    def __init__(self, openai: OpenAIRoutes, book: ResponseBook) -> None:
        self.openai = openai
        self.service = openai.service
        self.planner = openai.planner
        self.book = book
        self.locks = TurnLocks()  # per (owner, session a follow-up starts from)

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
        router.add_api_route("/responses", self.create_response, methods=["POST"])
        router.add_api_route("/responses/{response_id}", self.get_response, methods=["GET"])
        router.add_api_route("/responses/{response_id}", self.delete_response, methods=["DELETE"])
        router.add_api_route("/responses/{response_id}/input_items", self.list_input_items, methods=["GET"])
        return router

    async def create_response(self, body: ResponseBody, request: Request) -> Response:
        """A response to `input` (after the responses it follows, with `previous_response_id`): see the
        module docstring. Rendering and tokenizing run on a worker thread, as every chat request's do."""
        self.openai.check_model(body.model)
        owner = caller(request)
        responding = await run_in_threadpool(self._planned, body, owner)
        responding.generate = self.planner.sampling(body.generate_request(responding.plan.constraint), responding.plan)
        headers = ignored_fields_header(body)
        try:
            if body.store:
                responding.turn, responding.stream = await self._session_turn(request, responding)
                headers |= {chat_sessions.ID_HEADER: responding.turn.session_id,
                            chat_sessions.RECOMPUTED_HEADER: responding.turn.reason}
            else:
                [responding.stream] = await self.service.complete_choices(
                    responding.plan.prompts[0], responding.generate, 1, owner, connection(request))
        except InvalidArgumentError as error:  # the engine names its own fields; name the request's
            error.param = "max_output_tokens" if error.param == "max_tokens" else error.param
            raise
        if body.stream:
            response: Response = SseResponse(self._events(responding), [responding.stream],
                                             lambda failure: _error_event(responding, failure))
        else:
            response = JSONResponse(await unless_disconnected(request, self._whole(responding), [responding.stream]))
        response.headers.update(headers)
        return response

    async def get_response(self, response_id: str, request: Request) -> JSONResponse:
        stored = await run_in_threadpool(self.book.get, caller(request), response_id)
        return JSONResponse(stored.body)

    async def delete_response(self, response_id: str, request: Request) -> dict:
        await run_in_threadpool(self.book.delete, caller(request), response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def list_input_items(self, response_id: str, request: Request) -> JSONResponse:
        """Every input item the response consumed, newest first (OpenAI's default order), in one page."""
        stored = await run_in_threadpool(self.book.get, caller(request), response_id)
        items = stored.input_items[::-1]
        return JSONResponse({"object": "list", "data": items, "has_more": False,
                             "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None})

    # ---- making a response ----------------------------------------------------------------------------

    def _planned(self, body: ResponseBody, owner: str | None) -> _Responding:
        """The conversation read (the chain of earlier responses from the store) and planned (worker thread)."""
        items = input_items(body.input)
        chain = self.book.chain(owner, body.previous_response_id) if body.previous_response_id is not None else []
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        messages = system + conversation([*(item for response in chain for item in response.items()), *items], _cut_call)
        if not messages:
            raise InvalidArgumentError("the conversation is empty: send input", "input")
        tools = function_tools(body.tools or (), "tools[{index}].parameters")
        choice = body.tool_choice
        named = isinstance(choice, FunctionChoice)
        plan = self.planner.plan(ChatRequest(messages, tools, "function" if named else choice,
                                             choice.name if named else None, body.parallel_tool_calls,
                                             body.format_constraint(), messages_param="input", format_param="text.format"))
        return _Responding(body, owner, "resp_" + secrets.token_hex(24), int(time.time()),
                           self.openai.served_model(body.model), items, plan, chain[-1] if chain else None)

    async def _session_turn(self, request: Request, responding: _Responding) -> tuple[Turn, AsyncGenerationStream]:
        """The session the response generates in, holding its prompt, and its generate queued there."""
        owner, previous = responding.owner, responding.previous
        (prompt, add_bos), tokens = responding.plan.sources[0], responding.plan.prompts[0]
        threads = self.service.session_threads
        assert responding.generate is not None
        if previous is None:
            turn = await run_in_threadpool(started, self.service, owner, tokens, False, "new session")
            return turn, await self.service.generate(owner, turn.session_id, responding.generate, connection(request))
        async with self.locks(owner, previous.session_id):
            turn = await submitted([], lambda: self._continue(owner, previous, prompt, add_bos, tokens), threads)
            return turn, await self.service.generate(owner, turn.session_id, responding.generate, connection(request))

    def _continue(self, owner: str | None, previous: StoredResponse, prompt: str, add_bos: bool,
                  tokens: list[int]) -> Turn:
        """The previous response's session brought to hold the prompt: waits for the session's last generate
        to end, then continues it in place or forks it at the response's point (worker thread, lock held)."""
        try:
            history = self.service.sessions.settled(previous.session_id, owner)
        except NotFoundError:  # closed, or gone without persistence: rebuilt from the conversation
            return started(self.service, owner, tokens, False, "the previous response's session had ended")
        return continued(self.service, owner, previous.session_id, history[:previous.position], previous.segments,
                         prompt, add_bos, held=len(history), param="input")

    async def _whole(self, responding: _Responding) -> dict:
        """The response, built from the same events a stream sends."""
        final: dict = {}
        async for event in self._events(responding):
            final = event.get("response", final)
        return final

    async def _events(self, responding: _Responding) -> AsyncIterator[dict]:
        """Every event of the response in OpenAI's order; the record is stored before the last one."""
        assert responding.stream is not None and responding.generate is not None
        opening = self._response_json(responding, "in_progress", [])
        yield responding.event({"type": "response.created", "response": opening})
        yield responding.event({"type": "response.in_progress", "response": opening})
        text, output = self.planner.choice_text(responding.plan), ResponseOutput()
        result: GenerationResult | None = None
        async for delta in deltas(responding.stream, self.planner.tokenizer, responding.generate.stop, text.ended,
                                  self.planner.decoder(responding.plan)):
            pieces = text.push(delta.text)
            if delta.result is not None:
                result = delta.result
                pieces += text.finish(result.finish_reason)
            for piece in pieces:
                for event in output.push(piece):
                    yield responding.event(event)
        assert result is not None, "deltas() always ends with the final delta"
        complete = text.finish_reason(result.finish_reason) != "length"
        for event in output.finish(complete):
            yield responding.event(event)
        final = self._response_json(responding, "completed" if complete else "incomplete", output.items,
                                    self._usage(result, output.reasoning))
        if responding.turn is not None:
            await run_in_threadpool(self.book.put, responding.owner, self._record(responding, final, result))
        yield responding.event({"type": "response.completed" if complete else "response.incomplete", "response": final})

    def _record(self, responding: _Responding, final: dict, result: GenerationResult) -> StoredResponse:
        """The response as a point in its session: the history holds the prompt, then every generated token."""
        assert responding.turn is not None
        position = result.usage.prompt_tokens + result.usage.generated_tokens
        return StoredResponse(final, responding.items, responding.turn.session_id, position,
                              [*responding.turn.segments, Segment(position, GENERATED)], self.book.expiry())

    def _usage(self, result: GenerationResult, reasoning: str) -> dict:
        usage = result.usage
        thought = len(self.planner.tokenizer.encode(reasoning)) if reasoning else 0
        return {"input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.reused_tokens, "cache_write_tokens": usage.prefilled_tokens},
                "output_tokens": usage.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": min(thought, usage.generated_tokens)},
                "total_tokens": usage.prompt_tokens + usage.generated_tokens}

    def _response_json(self, responding: _Responding, status: str, output: list[Item], usage: dict | None = None) -> dict:
        """The response object as OpenAI's API returns it (what a request left out is reported as used)."""
        body, generate = responding.body, responding.generate
        assert generate is not None
        parallel = self.planner.parallel_calls if body.parallel_tool_calls is None else body.parallel_tool_calls
        return {
            "id": responding.response_id, "object": "response", "created_at": responding.created_at,
            "status": status, "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": responding.model, "output": output, "parallel_tool_calls": parallel,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": generate.temperature, "top_p": generate.top_p,
            "text": {"format": _format_json(body)}, "tool_choice": _tool_choice_json(body),
            "tools": [{"type": "function", "name": tool.name, "description": tool.description,
                       "parameters": tool.parameters, "strict": True} for tool in body.tools or ()],
            "truncation": "disabled", "usage": usage, "metadata": body.metadata or {},
        }


def _cut_call(item: Item) -> InvalidArgumentError:
    return InvalidArgumentError(f"the call {item['call_id']} ({item['name']}) of an earlier response was cut short: "
                                "its arguments are not a JSON object; start a new conversation", "previous_response_id")


def _format_json(body: ResponseBody) -> dict:
    form = body.text.format if body.text is not None else None
    if isinstance(form, JsonSchemaTextFormat):
        return {"type": "json_schema", "name": form.name, "schema": form.schema_, "description": form.description,
                "strict": True}
    return {"type": "json_object" if isinstance(form, JsonObjectFormat) else "text"}


def _tool_choice_json(body: ResponseBody) -> str | dict:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def _error_event(responding: _Responding, failure: dict) -> dict:
    """The `error` event an error after the stream began becomes (failure: the error envelope)."""
    error = failure["error"]
    return responding.event({"type": "error", "code": error["code"], "message": error["message"], "param": error["param"]})
