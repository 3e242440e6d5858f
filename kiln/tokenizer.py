"""Tokenizer: text <-> token ids for every model source Kiln loads.

An HF directory's tokenizer.json is used as it is, by `tokenizers`, as transformers does. A GGUF file carries
only llama.cpp's vocabulary metadata, and its token ids are llama.cpp's:

- "gpt2" vocabularies are byte-level BPE, encoded exactly as llama.cpp encodes them (kiln/gguf_encoder.py:
  its special tokens, its pre-tokenizer for `tokenizer.ggml.pre`, its merges); a `tokenizers.Tokenizer` over
  the same vocabulary decodes.
- "llama" vocabularies are SentencePiece BPE. SentencePiece merges the adjacent pair whose joined piece
  has the highest score; a `tokenizers` BPE whose merges are ranked by that score makes the same choices,
  so the merges are recovered from the scores. Pieces missing from the vocabulary fall back to bytes.
  Control tokens (`<start_of_turn>`) are special tokens matched whole in text, and user-defined tokens
  (Gemma's runs of spaces, newlines and tabs) are matched whole too: SentencePiece and llama.cpp never split
  or merge them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from kiln.errors import InvalidArgumentError
from kiln.gguf_encoder import GgufEncoder
from kiln.pretokenizers import pre_tokenizer
from kiln.special_tokens import SpecialToken, special_tokens

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL = 1

# GGUF names one EOS; like llama.cpp, also stop on the chat-turn terminators a vocabulary defines.
_TURN_END_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>")

_SPACE = "\u2581"  # SentencePiece's visible space

_BACKEND_FILE = "tokenizer.json"
_META_FILE = "tokenizer_kiln.json"

def check_unicode(text: str, what: str = "text") -> None:
    """Raises InvalidArgumentError naming `what` if `text` cannot be UTF-8 (a lone surrogate, e.g. from a
    JSON "\\ud800" escape): the one check for every text a request carries (prompts, messages, stop)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgumentError(f"{what} is not valid Unicode: {error.reason} at character {error.start}") from None


class Tokenizer:
    """Token ids for text and text for token ids. `encode` adds BOS (and EOS) exactly when the model's
    reference tokenizer does; `eos_token_ids` are every id that ends generation. `gguf_encoder`, for a
    byte-pair GGUF vocabulary, encodes in place of the backend."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        gguf_encoder: GgufEncoder | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.gguf_encoder = gguf_encoder
        self._literal_backend: tokenizers.Tokenizer | None = None

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """`parse_special=False` reads control tokens written in the text as plain text (llama.cpp's
        parse_special, transformers' split_special_tokens); user-defined tokens are matched either way."""
        check_unicode(text)
        if self.gguf_encoder is not None:
            return self.gguf_encoder.encode(text, add_special_tokens, parse_special)
        backend = self.backend if parse_special else self._literal()
        # The batch calls release the GIL while they work (encode/decode hold it): tokenizing megabytes
        # on a server thread must not stall the event loop and the engine.
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _literal(self) -> tokenizers.Tokenizer:
        """A copy of the backend that reads special tokens in text as plain text."""
        if self._literal_backend is None:
            literal = tokenizers.Tokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal_backend = literal
        return self._literal_backend

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
            "gguf_encoder": None if self.gguf_encoder is None else self.gguf_encoder.describe(),
        }
        (directory / _META_FILE).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: Path) -> Tokenizer:
        meta = json.loads((directory / _META_FILE).read_text())
        backend = tokenizers.Tokenizer.from_file(str(directory / _BACKEND_FILE))
        encoder = meta.get("gguf_encoder") and GgufEncoder.from_description(meta["gguf_encoder"], backend)
        return cls(backend, meta["bos_token_id"], meta["eos_token_ids"], meta["chat_template"], encoder or None)

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
        if kind not in ("llama", "gpt2"):
            raise InvalidArgumentError(f"unsupported GGUF tokenizer model {kind!r}; supported: llama, gpt2")
        try:
            tokens, specials = metadata["tokenizer.ggml.tokens"], special_tokens(metadata)
            if kind == "llama":
                backend, encoder = _sentencepiece_backend(metadata), None
            else:
                backend, encoder = _byte_level(metadata, specials)
        except KeyError as error:
            raise InvalidArgumentError(f"GGUF tokenizer metadata lacks {error}") from error
        _add_whole_tokens(backend, specials)
        bos = encoder.bos if encoder else metadata.get("tokenizer.ggml.bos_token_id")
        eos = encoder.eos if encoder else metadata.get("tokenizer.ggml.eos_token_id")
        add_bos = encoder.add_bos if encoder else metadata.get("tokenizer.ggml.add_bos_token", True)
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _template(tokens, bos if add_bos else None, eos if add_eos else None)
        chat_template = metadata.get("tokenizer.chat_template")
        return cls(backend, bos, _gguf_eos_ids(metadata, backend), chat_template, encoder)


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


def _byte_level(
    metadata: Mapping[str, Any], specials: Sequence[SpecialToken]
) -> tuple[tokenizers.Tokenizer, GgufEncoder]:
    """GPT-2-style byte-level BPE (Llama 3, Qwen, SmolLM): llama.cpp's encoder, and a backend over the same
    model that decodes (and, for tools that tokenize through tokenizer.json, splits as GPT-2 does)."""
    pre = pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    if not (pre.split.byte_encode or pre.escape_whitespaces):
        raise InvalidArgumentError(
            f"GGUF pre-tokenizer {pre.name!r} keeps spaces inside words of a byte-level ('gpt2') vocabulary, where "
            "llama.cpp fails an assertion (aborts) on any text with a space"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata.get("tokenizer.ggml.merges", [])]
    if any(len(merge) != 2 for merge in merges):
        raise InvalidArgumentError("GGUF tokenizer.ggml.merges has an entry that is not two tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # llama.cpp's defaults where the file names no BOS/EOS: id 11, GLM's none.
    bos = metadata.get("tokenizer.ggml.bos_token_id", None if pre.bos_disabled else _default_bos_eos(tokens))
    eos = metadata.get("tokenizer.ggml.eos_token_id", _default_bos_eos(tokens))
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", pre.add_bos) or pre.split.bos_forced
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    encoder = GgufEncoder(backend.model, vocab, pre, specials, bos, eos, add_bos, add_eos)
    return backend, encoder


def _default_bos_eos(tokens: Sequence[str]) -> int | None:
    return 11 if len(tokens) > 11 else None


def _add_whole_tokens(backend: tokenizers.Tokenizer, specials: Sequence[SpecialToken]) -> None:
    """llama.cpp's special tokens as added tokens, matched whole in the raw text before normalisation with
    their vocabulary ids: control and unknown ones as special tokens (skipped when decoding without special
    tokens), user-defined ones as plain added tokens."""
    whole = [
        AddedToken(special.text, special=special.control, normalized=False, lstrip=special.lstrip,
                   rstrip=special.rstrip)
        for special in specials
    ]
    backend.add_special_tokens([token for token in whole if token.special])
    backend.add_tokens([token for token in whole if not token.special])


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
