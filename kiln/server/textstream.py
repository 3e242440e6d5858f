"""Incremental detokenization for streamed replies.

Generated tokens arrive one at a time, but text can only be shown once it is final: a token may end in
the middle of a multi-byte character (the decoder then yields U+FFFD until the rest arrives), and the
tail of the text may be the start of a stop string that must never reach the client. TextDecoder
releases exactly the text that no later token can change or cut, and at the end the rest, cut before the
matched stop string, so the concatenated deltas equal the final reply text.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class TextDecoder:
    """Text deltas for one generation. Decoding matches the engine's stop-string check (special
    tokens skipped), so a stop string is found at the same place the engine found it."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._released = 0  # characters of the decoded text already handed out

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that became final (often "")."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids)
        return self._release(text, self._safe_end(text))

    def finish(self, stop_string: str | None) -> str:
        """The text not yet released, cut before `stop_string` (the one the engine matched, if any).
        A trailing U+FFFD here is a genuinely invalid byte sequence, so it is kept."""
        text = self._tokenizer.decode(self._ids)
        end = text.find(stop_string) if stop_string else -1
        return self._release(text, end if end >= 0 else len(text))

    def _release(self, text: str, end: int) -> str:
        if end <= self._released:
            return ""
        delta = text[self._released : end]
        self._released = end
        return delta

    def _safe_end(self, text: str) -> int:
        """End of the prefix of `text` that later tokens can neither change nor cut."""
        end = len(text.rstrip(REPLACEMENT))
        for stop in self._stop:
            found = text.find(stop)
            if found >= 0:
                end = min(end, found)
            end = min(end, len(text) - _partial_suffix(text, stop))
        return end


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
