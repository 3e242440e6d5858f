"""Text to token ids for a byte-pair ("gpt2") GGUF vocabulary, exactly as llama.cpp's `llama_tokenize`.

The text is cut at special tokens (kiln/special_tokens.py); each plain piece is split into words by the
file's pre-tokenizer (kiln/pretokenizers.py, run by kiln/regex_split.py), each word spelled in GPT-2's byte
alphabet and byte-pair merged on its own (a `tokenizers` BPE model: lowest merge rank first, leftmost first on
ties, as llama.cpp's `llm_tokenizer_bpe_session`); BOS and EOS are added as the vocabulary says. A character
the vocabulary lacks stays a symbol of its own that no merge crosses; llama.cpp then writes it as its byte
tokens, or drops it where there are none.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers

from kiln.pretokenizers import PreTokenizer, pre_tokenizer
from kiln.regex_split import split
from kiln.special_tokens import SpecialToken, SpecialTokenCutter


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (llama.cpp's unicode_byte_to_utf8_map)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    unprintable = iter(range(256, 512))
    return {byte: chr(byte if byte in printable else next(unprintable)) for byte in range(256)}


_BYTE_ALPHABET = _byte_alphabet()  # keyed by the Latin-1 character of each byte, for str.translate


class GgufEncoder:
    """llama.cpp's tokenizer for one byte-pair GGUF vocabulary. `bpe` is the vocabulary's BPE model (its
    merges, and ignore_merges as the pre-tokenizer says)."""

    def __init__(
        self,
        bpe: tokenizers.models.Model,
        vocab: Mapping[str, int],
        pre: PreTokenizer,
        specials: Sequence[SpecialToken],
        bos: int | None,
        eos: int | None,
        add_bos: bool,
        add_eos: bool,
    ) -> None:
        self.pre = pre
        self.cutter = SpecialTokenCutter(specials)
        self.bos, self.eos, self.add_bos, self.add_eos = bos, eos, add_bos, add_eos
        self._bpe = tokenizers.Tokenizer(bpe)  # words arrive split and spelled: no normaliser, no pre-tokenizer
        self._vocab = vocab
        missing = "".join(char for char in _BYTE_ALPHABET.values() if char not in vocab)
        # Byte-level words are checked for the bytes the vocabulary lacks (SmolLM2 lacks 21) in one search.
        self._missing_bytes = re.compile(f"[{re.escape(missing)}]") if missing else None

    @classmethod
    def from_description(cls, description: Mapping[str, Any], backend: tokenizers.Tokenizer) -> GgufEncoder:
        """The encoder `describe` wrote, over `backend`'s BPE model."""
        specials = [SpecialToken(*fields) for fields in description["specials"]]
        flags = (description["bos"], description["eos"], description["add_bos"], description["add_eos"])
        return cls(backend.model, backend.get_vocab(), pre_tokenizer(description["pre"]), specials, *flags)

    def describe(self) -> dict[str, Any]:
        """Everything but the BPE model, as JSON values."""
        specials = [[s.text, s.id, s.control, s.lstrip, s.rstrip] for s in self.cutter.specials]
        return {"pre": self.pre.name, "specials": specials, "bos": self.bos, "eos": self.eos,
                "add_bos": self.add_bos, "add_eos": self.add_eos}

    def encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        """llama_tokenize(text, add_special, parse_special)."""
        items: list[int | list[str]] = []  # token ids, and runs of words for BPE
        for piece in self.cutter.cut(text, parse_special):
            items.extend(self._words(piece) if isinstance(piece, str) else (piece,))
        runs = [item for item in items if isinstance(item, list)]
        # One batch call for every run: it releases the GIL while it merges.
        merged = iter(self._bpe.encode_batch(runs, is_pretokenized=True, add_special_tokens=False) if runs else ())
        ids = [self.bos] if add_special and self.add_bos and self.bos is not None else []
        for item in items:
            if isinstance(item, int):
                ids.append(item)
            else:
                ids.extend(next(merged).ids)
        if add_special and self.add_eos and self.eos is not None:
            ids.append(self.eos)
        return ids

    def _words(self, text: str) -> list[int | list[str]]:
        if self.pre.escape_whitespaces:
            text = text.replace(" ", "\u2581")
        words = split(text, self.pre.split.regexes)
        if not words:
            return []
        if self.pre.split.byte_encode:
            words = [word.encode().decode("latin-1").translate(_BYTE_ALPHABET) for word in words]
            if self._missing_bytes is None or not self._missing_bytes.search("".join(words)):
                return [words]
        return self._around_unknown_characters(words)

    def _around_unknown_characters(self, words: list[str]) -> list[int | list[str]]:
        """Words cut at each character the vocabulary lacks (so no merge crosses it), that character written
        as its byte tokens (`<0x..>`, for vocabularies not spelled in bytes) or dropped."""
        items: list[int | list[str]] = []
        run: list[str] = []
        for word in words:
            if self.pre.ignore_merges and word in self._vocab:
                run.append(word)
                continue
            if self.pre.split.newline_runs_whole and not word.strip("\n") and word in self._vocab:
                items.extend([run, self._vocab[word]] if run else [self._vocab[word]])
                run = []
                continue
            start = 0
            for index, char in enumerate(word):
                if char in self._vocab:
                    continue
                if start < index:
                    run.append(word[start:index])
                start = index + 1
                fallback = [] if self.pre.split.byte_encode else [
                    self._vocab[name] for byte in char.encode() if (name := f"<0x{byte:02X}>") in self._vocab]
                if fallback:
                    items.extend([run, *fallback] if run else fallback)
                    run = []
            if start < len(word):
                run.append(word[start:])
        if run:
            items.append(run)
        return items
