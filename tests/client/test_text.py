"""The SDK's tokenizer option: None (token ids only), "server", or a local encode/decode object."""

import pytest

from kiln.client.text import decode_locally, encode_locally, opt_in
from kiln.errors import InvalidArgumentError
from tests.conftest import byte_tokenizer

TOKENIZER = byte_tokenizer()


def test_tokenizer_option_must_be_server_or_have_encode_and_decode():
    assert opt_in(None) is None and opt_in("server") == "server" and opt_in(TOKENIZER) is TOKENIZER
    for bad in ("local", object()):
        with pytest.raises(InvalidArgumentError):
            opt_in(bad)


@pytest.mark.parametrize("local", [TOKENIZER, TOKENIZER.backend], ids=["kiln", "tokenizers"])
def test_a_local_tokenizer_round_trips_text(local):
    """kiln's Tokenizer returns ids; a `tokenizers.Tokenizer` returns an Encoding."""
    ids = encode_locally(local, "Grüße ✓", add_special_tokens=False)
    assert decode_locally(local, ids) == "Grüße ✓"
