"""The special tokens of a GGUF vocabulary, and text cut at them, as llama.cpp does.

llama.cpp matches control, user-defined and unknown tokens whole in the text before anything else
(`tokenizer_st_partition`): each one, longest first, wherever it occurs in the text left, control and unknown
ones only when special tokens are parsed. Which tokens those are is the file's token types as llama.cpp's
vocabulary loader adjusts them: it makes end-of-generation and fill-in-the-middle tokens control tokens by their
text, gpt-oss's channel tokens user-defined, and strips spaces beside the special tokens of Phi-3 models and
beside some embedding models' mask token (src/llama-vocab.cpp, `llama_vocab::impl::load`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# llama.cpp token types (tokenizer.ggml.token_type).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_C_SPACE = " \t\n\v\f\r"  # C isspace, which llama.cpp's lstrip/rstrip use

# Tokens llama.cpp makes control tokens by their text when the file does not name that kind's id.
_BY_KIND = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
            "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# The metadata keys that name each kind's id (the second, where there is one, is deprecated).
_KIND_KEYS = {
    "eot": ("eot",), "eom": ("eom",), "fim_pre": ("fim_pre", "prefix"), "fim_suf": ("fim_suf", "suffix"),
    "fim_mid": ("fim_mid", "middle"), "fim_pad": ("fim_pad",), "fim_rep": ("fim_rep",), "fim_sep": ("fim_sep",),
}
# End-of-generation tokens by text: all become control tokens.
_END_OF_GENERATION = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
)
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: user-defined


@dataclass(frozen=True)
class SpecialToken:
    """A token matched whole in text. `control`: only when special tokens are parsed (control and unknown
    tokens); `lstrip`/`rstrip`: spaces before/after it in the text are dropped."""

    text: str
    id: int
    control: bool
    lstrip: bool = False
    rstrip: bool = False


def special_tokens(metadata: Mapping[str, Any]) -> list[SpecialToken]:
    """The special tokens llama.cpp's loader makes of a GGUF file's `tokenizer.ggml.*` and `general.*` metadata."""
    tokens: Sequence[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    kind = {index: types[index] for index in range(len(tokens)) if types[index] in (_UNKNOWN, _CONTROL, _USER_DEFINED)}
    ids = {token: index for index, token in enumerate(tokens)}  # a repeated token: llama.cpp keeps the last

    def make_control(token: str) -> None:
        if token in ids and kind.get(ids[token]) not in (_CONTROL, _UNKNOWN):
            kind[ids[token]] = _CONTROL

    # Of each kind llama.cpp promotes the first such token its hash map yields: a vocabulary has one of each.
    for name, texts in _BY_KIND.items():
        if not any(f"tokenizer.ggml.{key}_token_id" in metadata for key in _KIND_KEYS[name]):
            for token in texts:
                make_control(token)
    for token in _END_OF_GENERATION:
        make_control(token)
    for token in _ALWAYS_RENDERED:
        if token in ids:
            kind[ids[token]] = _USER_DEFINED
    end_of_generation = _end_of_generation_texts(metadata, tokens, ids)
    calls = {"<|call|>", "<|calls|>"} & end_of_generation
    if "<|end|>" in end_of_generation and calls and {"<|return|>", "<|flush|>"} & end_of_generation:
        kind[ids["<|end|>"]] = _USER_DEFINED  # gpt-oss and Solar Open end a message, not the generation, here
    if "</s>" in end_of_generation and {"<|tool_response>", "<|plamo:eos|>"} & end_of_generation:
        kind.pop(ids["</s>"], None)  # Gemma 4 and PLaMo: a normal token
    lstrip, rstrip = _stripped(metadata, ids, kind)
    specials = [
        SpecialToken(tokens[index], index, kind[index] != _USER_DEFINED, index in lstrip, index in rstrip)
        for index in sorted(kind)
    ]
    specials.sort(key=lambda special: -len(special.text.encode()))
    return specials


def _end_of_generation_texts(metadata: Mapping[str, Any], tokens: Sequence[str], ids: Mapping[str, int]) -> set[str]:
    """The texts of llama.cpp's end-of-generation tokens: its list by text, the EOS/EOT/EOM ids, and the
    fill-in-the-middle pad, repo and separator tokens."""
    texts = {token for token in _END_OF_GENERATION if token in ids}
    for key in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"):
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= index < len(tokens):
            texts.add(tokens[index])
    for name in ("fim_pad", "fim_rep", "fim_sep", "eot", "eom"):
        if not any(f"tokenizer.ggml.{key}_token_id" in metadata for key in _KIND_KEYS[name]):
            texts.update(token for token in _BY_KIND[name] if token in ids)
    return texts


def _stripped(metadata: Mapping[str, Any], ids: Mapping[str, int], kind: Mapping[int, int]) -> tuple[set[int], set[int]]:
    """Ids whose preceding (lstrip) and following (rstrip) spaces llama.cpp drops, by model and tokenizer name."""
    pre = metadata.get("tokenizer.ggml.pre") or ""
    arch = metadata.get("general.architecture") or ""
    name = (metadata.get("general.name") or "").lower()
    if any(part in pre for part in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            part in arch for part in ("nomic-bert-moe", "jina-bert-v3")):
        return ({ids["<mask>"]} if "<mask>" in ids else set()), set()
    if "phi-3" in name or "phi3" in name:
        rstrip = (set(kind) | {ids["</s>"]} if "</s>" in ids else set(kind))
        return set(), rstrip - {ids[token] for token in ("<unk>", "<s>", "<|endoftext|>") if token in ids}
    if "modern-bert" in name:
        return ({ids["[MASK]"]} if "[MASK]" in ids else set()), set()
    return set(), set()


class SpecialTokenCutter:
    """Cuts text at special tokens as llama.cpp's `tokenizer_st_partition` does."""

    def __init__(self, specials: Iterable[SpecialToken]) -> None:
        self.specials = list(specials)
        self._order = {special.id: rank for rank, special in enumerate(self.specials)}
        # Only the special tokens that occur in a text take part: grouping them by their first three
        # characters finds those in a few scans of the text, not one per special token.
        self._by_prefix: dict[str, list[SpecialToken]] = defaultdict(list)
        for special in self.specials:
            self._by_prefix[special.text[:3]].append(special)

    def cut(self, text: str, parse_special: bool) -> list[str | int]:
        """`text` as pieces of plain text and special token ids, in order."""
        present = [
            special
            for prefix, group in self._by_prefix.items()
            if prefix in text
            for special in group
            if (parse_special or not special.control) and special.text in text
        ]
        pieces: list[str | int] = [text] if text else []
        for special in sorted(present, key=lambda special: self._order[special.id]):
            pieces = [part for piece in pieces for part in (_cut(piece, special) if isinstance(piece, str) else (piece,))]
        return pieces


def _cut(text: str, special: SpecialToken) -> list[str | int]:
    parts: list[str | int] = []
    start = 0
    while (found := text.find(special.text, start)) != -1:
        left = text[start:found]
        if special.lstrip:
            left = left.rstrip(_C_SPACE)
        if left:
            parts.append(left)
        parts.append(special.id)
        start = found + len(special.text)
        if special.rstrip:
            while start < len(text) and text[start] in _C_SPACE:
                start += 1
    if start < len(text):
        parts.append(text[start:])
    return parts
