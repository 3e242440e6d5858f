"""The SDK's opt-in tokenizer: the one piece of text handling that only a client has.

The runtime works on token ids. A client turns text into ids only if its user opted in when creating it:
`tokenizer="server"` (the Tokenize / Detokenize RPCs) or a local tokenizer (anything with
`encode(text, add_special_tokens=...)` and `decode(ids, skip_special_tokens=...)`, e.g. a transformers
or `tokenizers` tokenizer or kiln.tokenizer.Tokenizer). Turning the decoded ids of a stream into text
deltas is shared with the core, so it lives there (kiln.text.TextAssembler) and the SDK imports it.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import FailedPreconditionError, InvalidArgumentError

SERVER = "server"


def opt_in(tokenizer: Any) -> Any:
    """Checks the client's `tokenizer=` option: None (token ids only), "server", or a local tokenizer."""
    if tokenizer is None or uses_server(tokenizer):
        return tokenizer
    if isinstance(tokenizer, str) or not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise InvalidArgumentError(
            f'tokenizer must be None, "server" or an object with encode() and decode(), got {tokenizer!r}'
        )
    return tokenizer


def uses_server(tokenizer: Any) -> bool:
    return isinstance(tokenizer, str) and tokenizer == SERVER


def require(tokenizer: Any, what: str) -> None:
    """Raises a FailedPreconditionError explaining the opt-in when no tokenizer was chosen."""
    if tokenizer is None:
        raise FailedPreconditionError(
            f'{what} needs a tokenizer: create the client with tokenizer="server" (the server\'s tokenizer) '
            "or tokenizer=<a local tokenizer with encode() and decode()>, or work with token ids"
        )


def encode_locally(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(getattr(encoded, "ids", encoded))  # a `tokenizers.Tokenizer` returns an Encoding


def decode_locally(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)
