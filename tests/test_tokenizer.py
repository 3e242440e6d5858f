"""Tokenizer parity with independent references.

Embedded Gemma 3 GGUF ("llama" SentencePiece vocabulary): our ids must equal llama.cpp's (recorded), and both
- transformers' tokenizer converted from the same GGUF (it also matches control tokens in text), and
- the `sentencepiece` library running a ModelProto rebuilt from the GGUF's pieces, scores and types:
  SentencePiece is what Gemma's vocabulary was trained and is run with. The references differ only on runs
  of more than 31 spaces: SentencePiece (and llama.cpp) take the longest user-defined space-run piece
  first, while transformers merges the space runs as ordinary BPE pieces. We follow SentencePiece.

A tiny Llama-2-style vocabulary checks add_space_prefix and byte fallback against SentencePiece, and a
tiny GPT-2-style ("gpt2") GGUF written here checks the byte-level path against transformers, and a tiny HF
tokenizer directory checks `from_hf_dir` against transformers (special tokens parsed or not).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as sp_model
from tokenizers import pre_tokenizers, trainers

from kiln.errors import InvalidArgumentError
from kiln.models.embedded import embedded_model_path
from kiln.models.gguf_import import read_metadata
from kiln.tokenizer import Tokenizer
from tests.conftest import byte_tokenizer
from tests.test_tokenizer_llama_cpp import RECORDED, assert_matches_llama_cpp

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; isn't it?",
    "def mean(xs):\n    total = 0\n    for x in xs:\n\t\ttotal += x  # tab-indented\n    return total / len(xs)\n",
    "  leading spaces, trailing spaces   \n\n\n\nfour newlines, then    four spaces",
    "Crème brûlée, naïve café, Ångström, São Paulo, Zürich, façade",
    "日本語のテキストと中文文本，还有한국어。",
    "Emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧 with ZWJ",
    "Digits 0123456789, 3.14159, 1,000,000 and 2024-06-01T12:00:00Z",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<table><tr><td>cell</td></tr></table> and <b>bold</b>",
    "mixed\r\nline\rendings\x00 and control \x07 chars",
    "x" * 50 + " " + "ab" * 30,
]
LONG_SPACE_RUNS = [" " * 32, " " * 40 + "x" + " " * 64, "a" + " " * 33 + "b"]

# SentencePiece piece types, which GGUF token types copy.
_USER_DEFINED = 4


@pytest.fixture(scope="module")
def gemma_metadata() -> dict:
    return read_metadata(embedded_model_path())


@pytest.fixture(scope="module")
def gemma(gemma_metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf(gemma_metadata)


def sentencepiece_reference(metadata: dict) -> SentencePieceProcessor:
    """SentencePiece BPE with Gemma's pieces. llama.cpp stores user-defined space runs with real spaces;
    SentencePiece spells them with U+2581 as in Gemma's tokenizer.model."""
    proto = sp_model.ModelProto()
    pieces = zip(
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.scores"],
        metadata["tokenizer.ggml.token_type"],
        strict=True,
    )
    for piece, score, kind in pieces:
        spelled = piece.replace(" ", "\u2581") if kind == _USER_DEFINED and not piece.strip(" ") else piece
        proto.pieces.add(piece=spelled, score=score, type=kind)
    proto.trainer_spec.model_type = sp_model.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = metadata["tokenizer.ggml.unknown_token_id"]
    proto.trainer_spec.bos_id = metadata["tokenizer.ggml.bos_token_id"]
    proto.trainer_spec.eos_id = metadata["tokenizer.ggml.eos_token_id"]
    proto.trainer_spec.pad_id = metadata.get("tokenizer.ggml.padding_token_id", -1)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = metadata["tokenizer.ggml.add_space_prefix"]
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return SentencePieceProcessor(model_proto=proto.SerializeToString())


@pytest.mark.embedded
def test_gemma_matches_sentencepiece(gemma: Tokenizer, gemma_metadata: dict) -> None:
    reference = sentencepiece_reference(gemma_metadata)
    # SentencePiece does not match control tokens in text, so those texts are left to transformers.
    texts = [text for text in CORPUS + LONG_SPACE_RUNS if "_of_turn>" not in text]
    for text in texts:
        assert gemma.encode(text, add_special_tokens=False) == reference.encode(text), text


@pytest.mark.embedded
def test_gemma_matches_transformers(gemma: Tokenizer) -> None:
    from transformers import AutoTokenizer

    path = embedded_model_path()
    reference = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in CORPUS:
        assert gemma.encode(text) == reference.encode(text), text
        assert gemma.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False
        )


@pytest.mark.embedded
def test_gemma_matches_llama_cpp(gemma: Tokenizer) -> None:
    """llama.cpp's ids for the same file (tests/fixtures/tokenizer/record.py), special tokens parsed or not."""
    assert_matches_llama_cpp(gemma, RECORDED["sentencepiece"])


@pytest.mark.embedded
def test_gemma_round_trips_and_special_tokens(gemma: Tokenizer) -> None:
    for text in CORPUS + LONG_SPACE_RUNS:
        assert gemma.decode(gemma.encode(text, add_special_tokens=False), skip_special_tokens=False) == text
    plain = CORPUS[0]
    assert gemma.encode(plain)[0] == gemma.bos_token_id == 2
    assert gemma.decode(gemma.encode(plain)) == plain
    turn = gemma.encode("<start_of_turn>user\nhi<end_of_turn>", add_special_tokens=False)
    assert turn[0] == gemma.token_to_id("<start_of_turn>") == 105
    assert turn[-1] == gemma.token_to_id("<end_of_turn>") == 106
    assert gemma.eos_token_ids == (1, 106)
    assert gemma.vocab_size == 262144
    assert gemma.id_to_token(2) == "<bos>"


@pytest.mark.embedded
def test_save_load_round_trip(gemma: Tokenizer, tmp_path: Path) -> None:
    gemma.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert (again.bos_token_id, again.eos_token_ids, again.chat_template) == (2, (1, 106), None)
    for text in CORPUS:
        assert again.encode(text) == gemma.encode(text)


def tiny_sentencepiece_metadata(add_space_prefix: bool) -> dict:
    """A Llama-2-style vocabulary: <unk> <s> </s>, the 256 byte pieces, letters and some merges."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [
        "\u2581",
        *letters,
        *(f"\u2581{c}" for c in letters),
        "he",
        "ll",
        "llo",
        "hello",
        "\u2581hello",
        "\u2581\u2581",
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    kinds = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_sentencepiece_space_prefix_and_byte_fallback(add_space_prefix: bool) -> None:
    metadata = tiny_sentencepiece_metadata(add_space_prefix)
    ours, reference = Tokenizer.from_gguf(metadata), sentencepiece_reference(metadata)
    for text in ["hello", " hello  hello", "  leading", "héllo wörld ☃", "trailing  ", "a\tb\nc"]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == text
        assert ours.encode(text) == [1, *ids]


BYTE_LEVEL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTE_LEVEL_TEXTS = [
    "hello world, hello tokens! It's 12345 o'clock.",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n<think>ok</think>",
    "  indented\n\tcode()\n\n  done   ",
    "naïve café 日本 😀",
]


def write_byte_level_gguf(path: Path) -> None:
    """A Qwen2-style GGUF tokenizer: byte-level BPE trained here, control and user-defined tokens."""
    trained = tokenizers.Tokenizer(tokenizers.models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=BYTE_LEVEL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    trained.train_from_iterator(
        BYTE_LEVEL_TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer
    )
    vocab = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + ["<think>", "</think>"]
    types = [3 if token in BYTE_LEVEL_SPECIALS else 1 for token, _ in vocab] + [4, 4]
    merges = [" ".join(pair) for pair in _trained_merges(trained)]
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _trained_merges(trained: tokenizers.Tokenizer) -> list[list[str]]:
    return json.loads(trained.to_str())["model"]["merges"]


def test_byte_level_gguf_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = tmp_path / "tiny-bpe.gguf"
    write_byte_level_gguf(path)
    ours = Tokenizer.from_gguf(read_metadata(path))
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in BYTE_LEVEL_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_end|>") == [ours.token_to_id("<|im_end|>")]
    assert ours.encode("<think>") == [ours.token_to_id("<think>")]
    assert ours.bos_token_id == ours.token_to_id("<|endoftext|>")
    assert set(ours.eos_token_ids) == {ours.token_to_id("<|endoftext|>"), ours.token_to_id("<|im_end|>")}


def test_text_that_is_not_valid_unicode_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="not valid Unicode.*character 3"):
        byte_tokenizer().encode("abc\ud800x")


HF_TEXTS = [
    "hello world, it's 12345 o'clock",
    "<s>hi</s> <|im_start|>user\nhey<|im_end|>  <mask> x <think>y</think>",
    "naïve café 日本 😀  \n\n\t end  ",
]


def write_hf_directory(directory: Path) -> None:
    """An HF tokenizer directory: byte-level BPE trained here behind an NFC normaliser, BOS added by its
    post-processor, a special token that swallows the spaces before it, plain added tokens, and
    tokenizer_config.json naming BOS and EOS."""
    trained = tokenizers.Tokenizer(tokenizers.models.BPE())
    trained.normalizer = tokenizers.normalizers.NFC()
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    trained.train_from_iterator(HF_TEXTS * 20, trainer)
    trained.add_special_tokens([tokenizers.AddedToken("<mask>", lstrip=True, special=True, normalized=False)])
    trained.add_tokens([tokenizers.AddedToken(token, normalized=False) for token in ("<think>", "</think>")])
    trained.post_processor = tokenizers.processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    trained.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "add_bos_token": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))


def test_hf_directory_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    write_hf_directory(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    literal = AutoTokenizer.from_pretrained(tmp_path, split_special_tokens=True)
    for text in HF_TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == reference.encode(text, add_special_tokens=add)
            assert ours.encode(text, add, parse_special=False) == literal.encode(text, add_special_tokens=add)
    assert (ours.bos_token_id, ours.eos_token_ids) == (reference.bos_token_id, (reference.eos_token_id,))
