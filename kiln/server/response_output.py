"""A Responses API reply's output items, built from the pieces a chat reply's text becomes
(kiln/server/chat_plan.py ChoiceText: content, reasoning_content, a tool call's start and its arguments'
deltas), with the stream events that announce them in OpenAI's order. An item opens when its first piece
arrives and closes when a piece of another item does, or the reply ends:

    reasoning      response.output_item.added, response.content_part.added (reasoning_text),
                   response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done, response.output_item.done
    message        response.output_item.added, response.content_part.added (output_text),
                   response.output_text.delta..., response.output_text.done,
                   response.content_part.done, response.output_item.done
    function_call  response.output_item.added, response.function_call_arguments.delta...,
                   response.function_call_arguments.done, response.output_item.done

A reply with no item at all (the model ended at once) is one empty message. The item open when a reply is
cut short (max_output_tokens) ends with status "incomplete". Events carry no sequence_number: the caller
numbers everything it sends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.server.response_items import Item, item_id

_TEXT = {"message": "response.output_text", "reasoning": "response.reasoning_text"}  # an item with text: its events


@dataclass
class _Open:
    """The item being written: its index in the output, the item as announced, and its text so far."""

    index: int
    item: Item
    text: str = ""

    @property
    def kind(self) -> str:
        return str(self.item["type"])


@dataclass
class ResponseOutput:
    """One reply's output: `push` each piece, then `finish`; `items` holds the items once closed."""

    items: list[Item] = field(default_factory=list)
    reasoning: str = ""  # the reply's thinking, all of it (usage counts its tokens)
    _open: _Open | None = None

    def push(self, piece: dict) -> list[dict]:
        """The events of one piece of the reply (ChoiceText's chat pieces)."""
        if "reasoning_content" in piece:
            self.reasoning += piece["reasoning_content"]
            return self._text("reasoning", piece["reasoning_content"])
        if "content" in piece:
            return self._text("message", piece["content"]) if piece["content"] else []
        call = piece["tool_calls"][0]
        if "id" in call:
            events = self._close("completed")
            item = {"type": "function_call", "id": item_id("function_call"), "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            return events + self._start(item)
        assert self._open is not None and self._open.kind == "function_call", "arguments follow their call's start"
        self._open.text += call["function"]["arguments"]
        return [{"type": "response.function_call_arguments.delta", **self._where(),
                 "delta": call["function"]["arguments"]}]

    def finish(self, complete: bool) -> list[dict]:
        """The events that end the output: the open item closes ("incomplete" unless `complete`); an empty
        output gets its empty message first."""
        events = self._start(_message()) if not self.items and self._open is None else []
        return events + self._close("completed" if complete else "incomplete")

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open.kind != kind:
            events = self._close("completed") + self._start(_message() if kind == "message" else _reasoning())
        assert self._open is not None
        self._open.text += text
        return [*events, {"type": f"{_TEXT[kind]}.delta", **self._where(), "content_index": 0, "delta": text,
                          **({"logprobs": []} if kind == "message" else {})}]

    def _start(self, item: Item) -> list[dict]:
        self._open = _Open(len(self.items), item)
        events = [{"type": "response.output_item.added", "output_index": self._open.index, "item": dict(item)}]
        if self._open.kind in _TEXT:
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": _part(self._open.kind, "")})
        return events

    def _close(self, status: str) -> list[dict]:
        opened = self._open
        if opened is None:
            return []
        where, text = self._where(), opened.text
        if opened.kind == "function_call":
            item = {**opened.item, "arguments": text, "status": status}
            events = [{"type": "response.function_call_arguments.done", **where, "arguments": text}]
        else:
            part = _part(opened.kind, text)
            item = {**opened.item, "content": [part], "status": status}
            events = [{"type": f"{_TEXT[opened.kind]}.done", **where, "content_index": 0, "text": text,
                       **({"logprobs": []} if opened.kind == "message" else {})},
                      {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        self._open = None
        self.items.append(item)
        return [*events, {"type": "response.output_item.done", "output_index": opened.index, "item": item}]

    def _where(self) -> dict:
        assert self._open is not None
        return {"item_id": self._open.item["id"], "output_index": self._open.index}


def _part(kind: str, text: str) -> dict:
    """The content part of a message (output_text) or of a reasoning item (reasoning_text)."""
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}


def _message() -> Item:
    return {"type": "message", "id": item_id("message"), "role": "assistant", "status": "in_progress", "content": []}


def _reasoning() -> Item:
    return {"type": "reasoning", "id": item_id("reasoning"), "summary": [], "content": [], "status": "in_progress"}
