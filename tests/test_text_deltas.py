"""TextDeltas: streamed text never shows half a character or any part of a stop string."""

from kiln.text import TextDeltas
from tests.conftest import byte_tokenizer

TOKENIZER = byte_tokenizer()  # one token per byte: every multi-byte character spans several tokens


def stream(text: str, stop: tuple[str, ...] = (), stop_string: str | None = None) -> list[str]:
    decoder = TextDeltas(TOKENIZER.decode, stop)
    deltas = [decoder.push([token]) for token in TOKENIZER.encode(text)]
    return [*deltas, decoder.finish(stop_string)]


def test_multi_byte_characters_come_out_whole():
    deltas = stream("héllo ☃ 🔥!")
    assert "".join(deltas) == "héllo ☃ 🔥!"
    assert all("\ufffd" not in delta for delta in deltas)
    assert "🔥" in deltas  # released at once when its fourth byte arrives


def test_matched_stop_string_is_cut_and_never_streamed():
    deltas = stream("say END now", stop=("END",), stop_string="END")
    assert "".join(deltas) == "say "
    assert all("E" not in delta for delta in deltas)


def test_partial_stop_match_is_held_back_then_released():
    deltas = stream("an ENDless", stop=("ENDING",))
    assert "".join(deltas) == "an ENDless"
    released = ""
    for delta in deltas[:-1]:
        released += delta
        assert not any(released.endswith("ENDING"[:n]) for n in range(1, 6))


def test_invalid_bytes_at_the_end_are_kept():
    decoder = TextDeltas(TOKENIZER.decode)
    assert decoder.push(TOKENIZER.encode("a")[:1]) == "a"
    assert decoder.push(TOKENIZER.encode("é")[:1]) == ""  # first byte of two: held
    assert decoder.finish(None) == "\ufffd"
