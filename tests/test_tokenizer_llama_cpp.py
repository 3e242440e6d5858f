"""GGUF tokenizers against llama.cpp: Kiln's token ids must be llama.cpp's.

llama.cpp's ids are recorded in tests/fixtures/tokenizer/llama_cpp_ids.json by record.py beside it (the
llama-cpp-python version and build are named there): SmolLM2-135M-Instruct's byte-level vocabulary under every
pre-tokenizer name llama.cpp knows, and the embedded Gemma 3's SentencePiece vocabulary, on hard texts, with
special tokens parsed and BOS added as the vocabulary says, and with neither. Here each is rebuilt from the same
file's metadata with `tokenizer.ggml.pre` set as the recording set it. (Gemma's is checked in test_tokenizer.py,
which reads its metadata already.)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kiln.errors import InvalidArgumentError
from kiln.models.embedded import embedded_model_path
from kiln.models.gguf_import import read_metadata
from kiln.pretokenizers import PRE_TOKENIZERS
from kiln.tokenizer import Tokenizer

RECORDED = json.loads((Path(__file__).parent / "fixtures" / "tokenizer" / "llama_cpp_ids.json").read_text())
TEXTS: list[str] = RECORDED["texts"]
BY_NAME: dict[str, dict[str, list[int]]] = RECORDED["byte_level"]["by_pre_tokenizer"]
NO_NAME = ""  # the recording's key for a file without tokenizer.ggml.pre


@pytest.fixture(scope="module")
def smollm2_metadata() -> dict:
    return read_metadata(embedded_model_path("smollm2-135m-instruct"))


def with_pre_tokenizer(metadata: dict, name: str) -> dict:
    named = {key: value for key, value in metadata.items() if key != "tokenizer.ggml.pre"}
    return {**named, "tokenizer.ggml.pre": name} if name else named


def assert_matches_llama_cpp(tokenizer: Tokenizer, recorded: dict[str, list[int]]) -> None:
    for text, special, literal in zip(TEXTS, recorded["special"], recorded["literal"], strict=True):
        assert tokenizer.encode(text) == RECORDED["encodings"][special], text
        assert tokenizer.encode(text, add_special_tokens=False, parse_special=False) == \
            RECORDED["encodings"][literal], text


def test_llama_cpp_encoded_every_name_but_the_one_it_aborts_on() -> None:
    assert set(BY_NAME) == {*PRE_TOKENIZERS, NO_NAME} - {"whitespace"}
    assert RECORDED["byte_level"]["failed"] == {"whitespace": "aborted", "no-such-pre-tokenizer": "refused"}


@pytest.mark.parametrize("name", sorted(set(BY_NAME) - {NO_NAME}))
def test_byte_level_vocabulary_matches_llama_cpp(smollm2_metadata: dict, name: str) -> None:
    assert_matches_llama_cpp(Tokenizer.from_gguf(with_pre_tokenizer(smollm2_metadata, name)), BY_NAME[name])


def test_a_file_without_pre_tokenizer_warns_and_splits_as_default(
    smollm2_metadata: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kiln.pretokenizers"):
        tokenizer = Tokenizer.from_gguf(with_pre_tokenizer(smollm2_metadata, NO_NAME))
    assert "names no pre-tokenizer" in caplog.text
    assert_matches_llama_cpp(tokenizer, BY_NAME[NO_NAME])
    assert BY_NAME[NO_NAME] == BY_NAME["default"]


def test_a_pre_tokenizer_llama_cpp_does_not_know_is_refused(smollm2_metadata: dict) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown GGUF pre-tokenizer 'no-such-pre-tokenizer'"):
        Tokenizer.from_gguf(with_pre_tokenizer(smollm2_metadata, "no-such-pre-tokenizer"))


def test_a_pre_tokenizer_llama_cpp_aborts_on_is_refused(smollm2_metadata: dict) -> None:
    """llama.cpp's BPE asserts that no word holds a space; `whitespace` keeps them in a byte-level vocabulary."""
    with pytest.raises(InvalidArgumentError, match="'whitespace' keeps spaces inside words"):
        Tokenizer.from_gguf(with_pre_tokenizer(smollm2_metadata, "whitespace"))


def test_encoder_survives_save_and_load(smollm2_metadata: dict, tmp_path: Path) -> None:
    Tokenizer.from_gguf(with_pre_tokenizer(smollm2_metadata, "llama3")).save(tmp_path)
    assert_matches_llama_cpp(Tokenizer.load(tmp_path), BY_NAME["llama3"])
