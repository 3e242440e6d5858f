"""A reasoning model's thinking, kept apart from its answer.

Qwen 3, SmolLM3 and the DeepSeek R1 distills think in `<think>…</think>` before they answer. The OpenAI
chat API carries the thinking as `reasoning_content` (the convention of DeepSeek's API and vLLM), in the
message and in streamed deltas, and only the answer as `content`. A template that opens the thinking
itself (R1's generation prompt ends with `<think>\\n`) leaves the reply inside it from its first token;
one that closes it for the model (Qwen 3 with enable_thinking false) leaves none.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.text import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


# a thought as one lexeme: text up to the first </think> (and the whitespace after it), which it contains once
_THOUGHT_BODY = r"(?s:.*)<\/think>\s*/ & ~/(?s:.*)<\/think>(?s:.*)<\/think>(?s:.*)/"


def with_thought(rules: str, opened: bool) -> str:
    """Lark rules (llguidance dialect, a `start:` rule first) extended so the reply may first think
    (`<think>…</think>`), or, when the prompt `opened` the thinking, must first finish it: the grammar
    of a constrained reply (a tool call, a JSON answer) of a reasoning model, which thinks first."""
    first, _, rest = rules.partition("\n")
    answer = first.removeprefix("start:").strip()
    thought = f"THOUGHT: /{_THOUGHT_BODY}" if opened else f"THOUGHT: /<think>{_THOUGHT_BODY}"
    return "\n".join([f"start: THOUGHT{'' if opened else '?'} ({answer})", thought, rest])


def thinks(template: str | None) -> bool:
    """Whether a chat template is a reasoning model's (it writes or strips `</think>`)."""
    return bool(template) and THINK_CLOSE in template


def opened_in(prompt: str) -> bool:
    """Whether the rendered prompt ends inside thinking the template opened (the reply starts there)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


@dataclass
class ReasoningSplitter:
    """Splits a reply's text, fed in pieces as it is generated, into (reasoning, content) pairs of
    text that became certain. Thinking is what lies between a leading `<think>` (or the reply's start,
    when `opened`) and the first `</think>`; the whitespace after it is neither."""

    opened: bool = False
    _buffer: str = ""
    _mode: str = "undecided"  # undecided | opening | thinking | after | content

    def __post_init__(self) -> None:
        if self.opened:
            self._mode = "thinking"

    def push(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning = content = ""
        while self._buffer:
            if self._mode == "content":
                content += self._take(len(self._buffer))
            elif self._mode in ("opening", "after"):  # the newline after <think>, the whitespace after </think>
                self._buffer = self._buffer.lstrip("\n") if self._mode == "opening" else self._buffer.lstrip()
                if self._buffer:
                    self._mode = "thinking" if self._mode == "opening" else "content"
            elif self._mode == "thinking":
                end = self._buffer.find(THINK_CLOSE)
                if end < 0:
                    reasoning += self._take(len(self._buffer) - partial_suffix(self._buffer, THINK_CLOSE))
                    break
                reasoning += self._take(end)
                self._take(len(THINK_CLOSE))
                self._mode = "after"
            else:
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer = stripped[len(THINK_OPEN) :]
                    self._mode = "opening"
                elif not THINK_OPEN.startswith(stripped):
                    self._mode = "content"
                else:
                    break
        return reasoning, content

    def _take(self, count: int) -> str:
        taken, self._buffer = self._buffer[:count], self._buffer[count:]
        return taken

    def finish(self) -> tuple[str, str]:
        """What was held back when the text ends: an unclosed thinking's tail, or a reply too short to tell."""
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._mode == "thinking" else ("", rest if self._mode == "undecided" else "")
