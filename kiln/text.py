"""Text deltas of a streamed generation: which token ids to decode next and which text is final.

Every place that streams text shares this one piece of decoding: the in-process API (kiln.llm), the HTTP
server (kiln.server.generation), the CLI, and the Python SDK (kiln.client). It lives in the core, free
of torch and of any tokenizer, because the core must never import the SDK; the SDK imports it from here.
Whoever holds the tokenizer decodes (in this process, or over the Detokenize RPC); this module only
decides what to decode and what to release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what decoders show for an incomplete multi-byte character


class TextAssembler:
    """Text deltas of a generation whose tokens arrive in chunks. Someone else decodes (a local tokenizer
    or the Detokenize RPC, sync or async): this class says which ids to decode next (`to_decode`) and
    turns their text into deltas (`decoded`). The deltas concatenate to the reply.

    Text is released once no later token can change it: never half of a multi-byte character (decoded as
    U+FFFD until the rest arrives), never a tail that may be the start of a stop string. `finish` releases
    the rest, cut before the stop string the server matched.

    Decoding cost stays bounded: once the decoded window grows past WINDOW tokens, it restarts CONTEXT
    tokens before the end (one extra decode sets the new baseline), so each chunk costs O(WINDOW + chunk)
    rather than O(length of the reply).
    """

    WINDOW = 64
    CONTEXT = 8  # tokens of context kept when the window restarts (a character spans at most 4)

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._start = 0  # the window is ids[start:]
        self._text = ""  # the latest decode of the window
        self._released = 0  # characters of _text handed out
        self._stale = False  # ids arrived since the last decode
        self._restart: int | None = None  # a new window start whose baseline is still to be decoded

    def add(self, token_ids: Sequence[int]) -> None:
        self._ids.extend(token_ids)
        self._stale = bool(token_ids) or self._stale

    def to_decode(self) -> list[int] | None:
        """The ids whose text `decoded` needs next, or None when the text is up to date."""
        if self._stale:
            return self._ids[self._start :]
        return None if self._restart is None else self._ids[self._restart :]

    def decoded(self, text: str) -> str:
        """Takes the text of the ids `to_decode` returned; returns the text that became final."""
        if self._stale:
            return self._window_decoded(text)
        self._restarted(text)
        return ""

    def finish(self, stop_string: str | None) -> str:
        """The text not yet released, cut before `stop_string` when the server says one matched. A
        trailing U+FFFD now is a genuinely invalid byte sequence, so it is kept."""
        end = self._text.find(stop_string, self._released) if stop_string else -1
        return self._release(end if end >= 0 else len(self._text))

    def _window_decoded(self, text: str) -> str:
        self._stale = False
        self._text = text
        delta = self._release(self._safe_end())
        if len(self._ids) - self._start > self.WINDOW:
            self._restart = len(self._ids) - self.CONTEXT
        return delta

    def _restarted(self, text: str) -> None:
        """`text` decodes the last CONTEXT ids alone. When the text still held back (a partial
        character, the start of a stop string) lies within it, the window restarts there; otherwise it
        keeps growing until a later restart fits."""
        held = self._text[self._released :]
        if text.endswith(held):
            self._start = self._restart
            self._text, self._released = text, len(text) - len(held)
        self._restart = None

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        delta = self._text[self._released : end]
        self._released = end
        return delta

    def _safe_end(self) -> int:
        """End of the prefix of the window's text that no later token can change or cut. A trailing
        U+FFFD is a character still to complete, so stop strings are matched against the text before it:
        "x" then half of "é" may be the start of the stop string "xé"."""
        text = self._text.rstrip(REPLACEMENT)
        end = len(text)
        for stop in self._stop:
            found = text.find(stop, self._released)
            if found >= 0:
                end = min(end, found)
            end = min(end, len(text) - partial_suffix(text, stop))
        return end


def partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0


class TextDeltas:
    """A TextAssembler for callers that can decode synchronously (a tokenizer in this process)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()) -> None:
        self._assembler = TextAssembler(stop)
        self._decode = decode

    def push(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; returns the text that became final (often "")."""
        self._assembler.add(token_ids)
        pieces = []
        while (ids := self._assembler.to_decode()) is not None:
            pieces.append(self._assembler.decoded(self._decode(ids)))
        return "".join(pieces)

    def finish(self, stop_string: str | None) -> str:
        return self._assembler.finish(stop_string)
