"""Chat formatting for clients. The runtime core only sees token ids; these helpers turn messages into
ids the way the model was trained to read them (Gemma's turn format, or a plain transcript for models
without turn tokens), so that a session's history only ever grows by appending."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kiln.tokenizer import Tokenizer

GEMMA_START, GEMMA_END = "<start_of_turn>", "<end_of_turn>"
ROLE_NAMES = {"assistant": "model", "model": "model", "user": "user", "system": "user"}


def uses_gemma_turns(tokenizer: Tokenizer) -> bool:
    return tokenizer.token_to_id(GEMMA_START) is not None and tokenizer.token_to_id(GEMMA_END) is not None


def turn_text(role: str, content: str, tokenizer: Tokenizer) -> str:
    """One complete turn, ready to append after the previous one."""
    if uses_gemma_turns(tokenizer):
        return f"{GEMMA_START}{ROLE_NAMES.get(role, role)}\n{content}{GEMMA_END}\n"
    return f"{role.capitalize()}: {content}\n"


def reply_prefix(tokenizer: Tokenizer) -> str:
    """What opens the model's turn; generation continues from here."""
    return f"{GEMMA_START}model\n" if uses_gemma_turns(tokenizer) else "Assistant:"


def turn_closer(tokenizer: Tokenizer, last_token: int | None) -> str:
    """Text that must follow a finished reply before the next turn: Gemma replies end with
    <end_of_turn> (then a newline follows); a reply cut short needs the marker too."""
    if not uses_gemma_turns(tokenizer):
        return "\n"
    return "\n" if last_token == tokenizer.token_to_id(GEMMA_END) else f"{GEMMA_END}\n"


def tokens_for_chat(messages: Iterable[Mapping[str, str]], tokenizer: Tokenizer) -> list[int]:
    """Token ids of a whole conversation (BOS, every turn, then the opening of the model's reply)."""
    text = "".join(turn_text(m["role"], m["content"], tokenizer) for m in messages) + reply_prefix(tokenizer)
    return tokenizer.encode(text, add_special_tokens=True)
