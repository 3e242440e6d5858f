"""Tokenizer: text <-> token ids for every model source Kiln loads.

One `tokenizers.Tokenizer` does the work. An HF directory's tokenizer.json is used as it is. A GGUF file
carries only llama.cpp's vocabulary metadata, so the backend is rebuilt from it:

- "llama" vocabularies are SentencePiece BPE. SentencePiece merges the adjacent pair whose joined piece
  has the highest score; a `tokenizers` BPE whose merges are ranked by that score makes the same choices,
  so the merges are recovered from the scores. Pieces missing from the vocabulary fall back to bytes.
- "gpt2" vocabularies are byte-level BPE with the merges stored in the file and a split regex chosen by
  `tokenizer.ggml.pre`.

In both, control tokens (`<start_of_turn>`) are special tokens matched whole in text, and user-defined
tokens (Gemma's runs of spaces, newlines and tabs, `<think>`) are matched whole too: SentencePiece and
llama.cpp never split or merge them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from kiln.errors import InvalidArgumentError

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4

# GGUF names one EOS; like llama.cpp, also stop on the chat-turn terminators a vocabulary defines.
_TURN_END_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>")

_SPACE = "\u2581"  # SentencePiece's visible space

_BACKEND_FILE = "tokenizer.json"
_META_FILE = "tokenizer_kiln.json"

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _ByteLevelScheme:
    """How a byte-level vocabulary splits text before BPE, as its reference tokenizer.json does."""

    split: str
    ignore_merges: bool = False  # a whole pre-token found in the vocabulary is one token (Llama 3)
    nfc: bool = False  # Qwen2 normalises to NFC first


_BYTE_LEVEL_SCHEMES = {
    "default": _ByteLevelScheme(_GPT2_SPLIT),
    "gpt-2": _ByteLevelScheme(_GPT2_SPLIT),
    "llama-bpe": _ByteLevelScheme(_LLAMA3_SPLIT, ignore_merges=True),
    "llama3": _ByteLevelScheme(_LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": _ByteLevelScheme(_QWEN2_SPLIT, nfc=True),
    "deepseek-r1-qwen": _ByteLevelScheme(_QWEN2_SPLIT, nfc=True),
}


def check_unicode(text: str, what: str = "text") -> None:
    """Raises InvalidArgumentError naming `what` if `text` cannot be UTF-8 (a lone surrogate, e.g. from a
    JSON "\\ud800" escape): the one check for every text a request carries (prompts, messages, stop)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"{what} is not valid Unicode: {error.reason} at character {error.start}") from None


class Tokenizer:
    """Token ids for text and text for token ids. `encode` adds BOS (and EOS) exactly when the model's
    reference tokenizer does; `eos_token_ids` are every id that ends generation."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        check_unicode(text)
        # The batch calls release the GIL while they work (encode/decode hold it): tokenizing megabytes
        # on a server thread must not stall the event loop and the engine.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def save(self, directory: Path) -> None:
        """Write tokenizer.json plus Kiln's ids and chat template; `load` reads them back unchanged."""
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / _BACKEND_FILE))
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "chat_template": self.chat_template,
        }
        (directory / _META_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        meta = json.loads((directory / _META_FILE).read_text())
        backend = tokenizers.Tokenizer.from_file(str(directory / _BACKEND_FILE))
        return cls(backend, meta["bos_token_id"], meta["eos_token_ids"], meta["chat_template"])

    @classmethod
    def from_hf_dir(cls, directory: Path) -> Tokenizer:
        """An HF model directory: tokenizer.json (its post-processor adds BOS), with BOS/EOS ids from
        generation_config.json, else config.json, plus tokenizer_config.json's named tokens."""
        path = directory / _BACKEND_FILE
        if not path.is_file():
            raise InvalidArgumentError(
                f"{directory} has no tokenizer.json (a SentencePiece-only tokenizer is not supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception for malformed files
            raise InvalidArgumentError(f"{path} is not a readable tokenizer.json: {error}") from error
        settings = _read_json(directory / "tokenizer_config.json")
        ids = {**_read_json(directory / "config.json"), **_read_json(directory / "generation_config.json")}
        bos = _named_token_id(backend, settings.get("bos_token"))
        if bos is None:
            bos = ids.get("bos_token_id")
        eos = [_named_token_id(backend, settings.get("eos_token")), *_as_list(ids.get("eos_token_id"))]
        return cls(backend, bos, _unique(eos), _hf_chat_template(directory, settings))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """A GGUF file's `tokenizer.ggml.*` metadata (plain Python values) as the tokenizer it describes."""
        kind = metadata.get("tokenizer.ggml.model")
        builders = {"llama": _sentencepiece_backend, "gpt2": _byte_level_backend}
        if kind not in builders:
            raise InvalidArgumentError(f"unsupported GGUF tokenizer model {kind!r}; supported: llama, gpt2")
        try:
            tokens, types = metadata["tokenizer.ggml.tokens"], _token_types(metadata)
            backend = builders[kind](metadata)
        except KeyError as error:
            raise InvalidArgumentError(f"GGUF tokenizer metadata lacks {error}") from error
        _add_whole_tokens(backend, tokens, types)
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _template(tokens, bos if add_bos else None, eos if add_eos else None)
        return cls(backend, bos, _gguf_eos_ids(metadata, backend), metadata.get("tokenizer.chat_template"))


def _sentencepiece_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """SentencePiece BPE: merges ranked by the score of the piece they make, byte fallback, spaces
    shown as U+2581 and, with add_space_prefix, one prepended to the text."""
    tokens = metadata["tokenizer.ggml.tokens"]
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(
        {piece: index for index, piece in enumerate(tokens)},
        _merges_from_scores(tokens, metadata["tokenizer.ggml.scores"], _token_types(metadata)),
        unk_token=None if unk is None else tokens[unk],
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    # Not a Metaspace pre-tokenizer: it skips the prefix when the text starts with a space; SentencePiece
    # (and llama.cpp, which also prefixes the text after each special token) does not.
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    escape = normalizers.Replace(" ", _SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if prefix else escape
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _token_types(metadata: Mapping[str, Any]) -> Sequence[int]:
    """llama.cpp token types; files without them have only normal tokens."""
    return metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(metadata["tokenizer.ggml.tokens"])


def _merges_from_scores(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best joined-piece score first. User-defined
    and control pieces never take part in SentencePiece merges, so they are left out."""
    normal = {piece for piece, kind in zip(tokens, types, strict=True) if kind == _NORMAL}
    ranked = [
        (-scores[index], index, cut)
        for index, piece in enumerate(tokens)
        if types[index] == _NORMAL
        for cut in range(1, len(piece))
        if piece[:cut] in normal and piece[cut:] in normal
    ]
    ranked.sort()
    return [(tokens[index][:cut], tokens[index][cut:]) for _, index, cut in ranked]


def _byte_level_backend(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE (Llama 3, Qwen): tokens are spelled in GPT-2's byte alphabet."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    scheme = _BYTE_LEVEL_SCHEMES.get(pre)
    if scheme is None:
        raise InvalidArgumentError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(sorted(_BYTE_LEVEL_SCHEMES))}"
        )
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise InvalidArgumentError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    vocab = {token: index for index, token in enumerate(metadata["tokenizer.ggml.tokens"])}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=scheme.ignore_merges))
    if scheme.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(scheme.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_whole_tokens(backend: tokenizers.Tokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control and unknown tokens become special tokens, user-defined ones plain added tokens: both are
    matched whole in the raw text, before normalisation, and keep their vocabulary ids."""

    def whole(kinds: tuple[int, ...], special: bool) -> list[AddedToken]:
        return [
            AddedToken(token, special=special, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind in kinds
        ]

    backend.add_special_tokens(whole((_CONTROL, _UNKNOWN), special=True))
    backend.add_tokens(whole((_USER_DEFINED,), special=False))


def _template(
    tokens: Sequence[str], bos: int | None, eos: int | None
) -> processors.TemplateProcessing | None:
    """The post-processor that wraps one text in BOS and/or EOS, or None when neither is added."""
    if bos is None and eos is None:
        return None
    first = [] if bos is None else [tokens[bos]]
    last = [] if eos is None else [tokens[eos]]
    ends = [(tokens[i], i) for i in (bos, eos) if i is not None]
    return processors.TemplateProcessing(single=" ".join([*first, "$A", *last]), special_tokens=ends)


def _gguf_eos_ids(metadata: Mapping[str, Any], backend: tokenizers.Tokenizer) -> tuple[int, ...]:
    """The declared EOS, the EOT/EOM ids if given, then the turn terminators the vocabulary has."""
    declared = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    named = [backend.token_to_id(token) for token in _TURN_END_TOKENS]
    return _unique([*declared, *named])


def _named_token_id(backend: tokenizers.Tokenizer, token: str | dict | None) -> int | None:
    """tokenizer_config.json names tokens as a string or as an AddedToken dict with `content`."""
    content = token.get("content") if isinstance(token, dict) else token
    return None if content is None else backend.token_to_id(content)


def _hf_chat_template(directory: Path, settings: Mapping[str, Any]) -> str | None:
    """transformers 5 writes chat_template.jinja; older directories keep it in tokenizer_config.json,
    possibly as a list of named templates."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = settings.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(f"{path} is not readable JSON: {error}") from error


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _unique(ids: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None))
