"""Shared fixtures: tiny Kiln engines over randomly initialised models (see tests/tiny_models.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from kiln.config import EngineConfig
from kiln.kv.codec import KVCodec
from kiln.kv.layout import KVLayout
from kiln.llm import LLM
from kiln.models.loader import LoadedModel
from kiln.tokenizer import Tokenizer
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model


def outcome_within(call: Callable[[], object], timeout_s: float, what: str) -> object:
    """call()'s result or the exception it raised, run on a thread; fails (instead of hanging the run)
    when it has not ended within `timeout_s`, saying `what` was never reached."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as error:  # noqa: BLE001 - the caller asserts on it
            outcome.append(error)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout_s)
    assert outcome, what
    return outcome[0]


def byte_tokenizer() -> Tokenizer:
    """One token per byte (256 ids, the tiny models' vocabulary): any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=(2,))


@pytest.fixture(scope="session")
def tiny_loaded():
    """LoadedModel of each tiny architecture, built once per test session."""
    built: dict[str, LoadedModel] = {}

    def get(arch: str) -> LoadedModel:
        if arch not in built:
            config = TINY_CONFIGS[arch]
            built[arch] = LoadedModel(
                config=config,
                tensors=hf_state_dict(tiny_hf_model(arch)),
                tokenizer=byte_tokenizer(),
                source=Path(f"tiny-{arch}"),
                fingerprint=f"tiny-{arch}",
            )
        return built[arch]

    return get


@pytest.fixture
def tiny_llm(tiny_loaded):
    """Factory: tiny_llm(arch, kv_pages=None, **engine_options) -> LLM; closed after the test.
    `kv_pages` sizes the KV budget in pages instead of bytes."""
    made: list[LLM] = []

    def make(arch: str, kv_pages: int | None = None, **options: object) -> LLM:
        loaded = tiny_loaded(arch)
        options.setdefault("kv_budget_bytes", 16 * 1024**2)
        if kv_pages is not None:
            layout = KVLayout.for_model(loaded.config, int(options.get("page_size", 16)))
            config = EngineConfig.from_kwargs(**options)
            codec = KVCodec(config.kv_codec, layout, config.torch_kv_dtype)
            options["kv_budget_bytes"] = kv_pages * codec.page_nbytes
        llm = LLM(loaded=loaded, **options)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture(params=["avx2", "avx512_vnni"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each instruction-set path of the kernels in turn (kiln/kernels/isa.h), the AVX2 one forced on an
    AVX-512 host; the AVX-512 VNNI one where the CPU has it."""
    from kiln.kernels import kernels

    if request.param == "avx512_vnni" and not kernels().cpu_has_avx512_vnni():
        pytest.skip("this CPU has no AVX-512 VNNI; its path is tested where it has")
    previous = kernels().use_isa(request.param)
    yield request.param
    kernels().use_isa(previous)
