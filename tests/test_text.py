"""TextAssembler: text deltas of streamed token chunks, decoded in bounded windows."""

import pytest

from kiln.text import TextAssembler
from tests.conftest import byte_tokenizer

TOKENIZER = byte_tokenizer()  # one id per UTF-8 byte: multi-byte characters always span several ids
TEXT = "Grüße aus Köln ✓ 日本語 🎉 " * 12  # 12 repeats: far longer than one decode window


def ids_of(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def stream(text_ids: list[int], chunk: int, stop: tuple[str, ...] = (), stop_string: str | None = None):
    """(pieces, lengths of the id windows decoded) for ids arriving `chunk` at a time."""
    assembler, pieces, windows = TextAssembler(stop), [], []
    for start in range(0, len(text_ids), chunk):
        assembler.add(text_ids[start : start + chunk])
        while (ids := assembler.to_decode()) is not None:
            windows.append(len(ids))
            pieces.append(assembler.decoded(TOKENIZER.decode(ids)))
    pieces.append(assembler.finish(stop_string))
    return [piece for piece in pieces if piece], windows


@pytest.mark.parametrize("chunk", [1, 3, 50])
def test_pieces_are_whole_characters_and_add_up_to_the_text(chunk):
    pieces, windows = stream(ids_of(TEXT), chunk)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    assert max(windows) <= TextAssembler.WINDOW + chunk  # decoding cost does not grow with the text


def test_text_is_cut_before_the_matched_stop_string_and_its_start_is_held_back():
    text = "Hello, wor" + "ld STOP and more"
    ids = ids_of(text)[: len("Hello, world STOP")]  # the engine stops once the stop string completed
    pieces, _ = stream(ids, 1, stop=("STOP",), stop_string="STOP")
    assert "".join(pieces) == "Hello, world "
    assert all(not piece.endswith(("S", "ST", "STO")) for piece in pieces[:-1])


def test_a_held_back_prefix_of_a_stop_string_is_released_when_it_does_not_complete():
    pieces, _ = stream(ids_of("a ST b"), 1, stop=("STOP",))
    assert "".join(pieces) == "a ST b"


def test_an_invalid_byte_at_the_end_is_kept():
    ids = ids_of("ab") + ids_of("é")[:1]  # the first byte of a two-byte character only
    pieces, _ = stream(ids, 1)
    assert "".join(pieces) == "ab\ufffd"


@pytest.mark.parametrize("chunk", [1, 2, 3, 4])
@pytest.mark.parametrize("stop", ["xé", "z✓", "日本", "z🎉"])
def test_the_start_of_a_stop_string_ending_in_a_multi_byte_character_is_held_back(chunk, stop):
    """While the stop string's last character is half-decoded (U+FFFD), its start is still held back;
    the long prefix makes the window restart on the way."""
    prefix = "Grüße aus Köln " * 8 + "a"
    ids = ids_of(prefix + stop + " and more")[: len((prefix + stop).encode())]
    pieces, windows = stream(ids, chunk, stop=(stop,), stop_string=stop)
    assert "".join(pieces) == prefix
    assert max(windows) <= TextAssembler.WINDOW + chunk
