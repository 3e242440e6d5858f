"""REST sessions: the gRPC session surface for clients without gRPC, plus tokenize/detokenize.

    POST   /v1/sessions                  create (optional token_ids, ttl_s)       -> session info (201)
    GET    /v1/sessions                  the caller's sessions
    GET    /v1/sessions/{id}             info
    GET    /v1/sessions/{id}/tokens      the history's token ids
    POST   /v1/sessions/{id}/tokens      append token_ids                          -> info
    POST   /v1/sessions/{id}/generate    continue the history: a JSON result, or with stream=true
                                         SSE events {"token_id", "logprob", "text"} per token, then one
                                         {"finish_reason", "text", "usage", ...}, then [DONE]; one of
                                         json_schema, regex, grammar constrains the generated text
    POST   /v1/sessions/{id}/fork        optional at                               -> the new session (201)
    DELETE /v1/sessions/{id}             close
    POST   /v1/sessions/{id}/snapshot    save a checkpoint                         -> snapshot info (201)
    GET    /v1/snapshots                 the caller's checkpoints
    GET    /v1/snapshots/{id}            snapshot info
    POST   /v1/snapshots/{id}/restore    a new session from it                     -> session info (201)
    DELETE /v1/snapshots/{id}            delete
    POST   /v1/tokenize, /v1/detokenize

Bodies whose fields all have defaults may be left out. Every session call passes the caller's
identity as owner: another key's session is NOT_FOUND, exactly like one that never existed.

Every route but generate is a plain function, which FastAPI runs on its thread pool: the service may
tokenize megabytes or wait for the engine's lock, and the event loop must keep serving everyone else.
Generate stays on the loop, which its stream belongs to. Token lists leave as a JSONResponse, rendered
on that thread too: a returned dict is encoded by FastAPI on the loop, about 1.5 s per million ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kiln.engine.stream import AsyncGenerationStream
from kiln.results import GenerationResult, SessionInfo
from kiln.server.generation import Output, SseResponse, collect, deltas, unless_disconnected, unless_gone
from kiln.server.http_auth import Owner, connection
from kiln.server.http_models import (
    AppendBody,
    CreateSessionBody,
    DetokenizeBody,
    ForkBody,
    JsonBodyRoute,
    SessionGenerateBody,
    TokenizeBody,
)
from kiln.server.service import RuntimeService

# what a left-out body means (bodies are frozen, so one instance serves every request)
_EMPTY_CREATE, _EMPTY_FORK, _EMPTY_GENERATE = CreateSessionBody(), ForkBody(), SessionGenerateBody()


class SessionRoutes:
    def __init__(self, service: RuntimeService) -> None:
        self.service = service

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/v1", route_class=JsonBodyRoute)
        routes = [
            ("/sessions", self.create, "POST", 201),
            ("/sessions", self.list_sessions, "GET", 200),
            ("/sessions/{session_id}", self.info, "GET", 200),
            ("/sessions/{session_id}", self.close, "DELETE", 200),
            ("/sessions/{session_id}/tokens", self.history, "GET", 200),
            ("/sessions/{session_id}/tokens", self.append, "POST", 200),
            ("/sessions/{session_id}/generate", self.generate, "POST", 200),
            ("/sessions/{session_id}/fork", self.fork, "POST", 201),
            ("/sessions/{session_id}/snapshot", self.snapshot, "POST", 201),
            ("/snapshots", self.list_snapshots, "GET", 200),
            ("/snapshots/{snapshot_id}", self.snapshot_info, "GET", 200),
            ("/snapshots/{snapshot_id}", self.delete_snapshot, "DELETE", 200),
            ("/snapshots/{snapshot_id}/restore", self.restore, "POST", 201),
            ("/tokenize", self.tokenize, "POST", 200),
            ("/detokenize", self.detokenize, "POST", 200),
        ]
        for path, endpoint, method, status in routes:
            router.add_api_route(path, endpoint, methods=[method], status_code=status)
        return router

    def create(self, owner: Owner, body: CreateSessionBody = _EMPTY_CREATE) -> dict:
        return session_json(self.service.create_session(
            owner, body.token_ids, body.ttl_s, body.kv_policy, body.kv_sink_tokens, body.kv_window_tokens))

    def list_sessions(self, owner: Owner) -> dict:
        return {"object": "list", "data": [session_json(info) for info in self.service.list_sessions(owner)]}

    def info(self, session_id: str, owner: Owner) -> dict:
        return session_json(self.service.info(owner, session_id))

    def close(self, session_id: str, owner: Owner) -> dict:
        self.service.close(owner, session_id)
        return {"session_id": session_id, "deleted": True}

    def history(self, session_id: str, owner: Owner) -> JSONResponse:
        return JSONResponse({"session_id": session_id, "token_ids": self.service.history(owner, session_id)})

    def append(self, session_id: str, body: AppendBody, owner: Owner) -> dict:
        return session_json(self.service.append(owner, session_id, body.token_ids))

    def fork(self, session_id: str, owner: Owner, body: ForkBody = _EMPTY_FORK) -> dict:
        return session_json(self.service.fork(owner, session_id, body.at))

    def snapshot(self, session_id: str, owner: Owner) -> dict:
        return dataclasses.asdict(self.service.snapshot(owner, session_id))

    def list_snapshots(self, owner: Owner) -> dict:
        return {"object": "list", "data": [dataclasses.asdict(info) for info in self.service.list_snapshots(owner)]}

    def snapshot_info(self, snapshot_id: str, owner: Owner) -> dict:
        return dataclasses.asdict(self.service.snapshot_info(owner, snapshot_id))

    def delete_snapshot(self, snapshot_id: str, owner: Owner) -> dict:
        self.service.delete_snapshot(owner, snapshot_id)
        return {"snapshot_id": snapshot_id, "deleted": True}

    def restore(self, snapshot_id: str, owner: Owner) -> dict:
        return session_json(self.service.restore(owner, snapshot_id))

    async def generate(self, session_id: str, owner: Owner, request: Request,
                       body: SessionGenerateBody = _EMPTY_GENERATE) -> Response:
        stream = await unless_gone(request, self.service.generate(owner, session_id, body.generate_request(), connection(request)))
        if body.stream:
            return SseResponse(self._events(stream, body.stop_strings), [stream])
        output = await unless_disconnected(request, collect(stream, self.service.llm.tokenizer, body.stop_strings),
                                           [stream])
        return JSONResponse(_result_json(session_id, output))

    def tokenize(self, body: TokenizeBody) -> JSONResponse:
        return JSONResponse({"token_ids": self.service.tokenize(body.text, body.add_special_tokens)})

    def detokenize(self, body: DetokenizeBody) -> dict:
        return {"text": self.service.detokenize(body.token_ids, body.skip_special_tokens)}

    async def _events(self, stream: AsyncGenerationStream, stop: tuple[str, ...]) -> AsyncIterator[dict]:
        async for delta in deltas(stream, self.service.llm.tokenizer, stop):
            if delta.result is None:
                yield {"token_id": delta.token_id, "logprob": delta.logprob, "text": delta.text}
            else:
                yield {"text": delta.text, **_finish_json(delta.result)}


def session_json(info: SessionInfo) -> dict:
    return dataclasses.asdict(info)


def _finish_json(result: GenerationResult) -> dict:
    return {"finish_reason": result.finish_reason, "stop_string": result.stop_string,
            "usage": dataclasses.asdict(result.usage)}


def _result_json(session_id: str, output: Output) -> dict:
    result = output.result
    return {"session_id": session_id, "token_ids": result.token_ids, "text": output.text,
            "logprobs": result.logprobs, **_finish_json(result)}
