"""The deterministic mode: a sequence's logits are bit-identical computed at once, token by token, in
uneven chunks, or batched with unrelated sequences (batch-invariant linear and attention kernels), on
every tiny architecture, through the engine, and on the embedded model; and they are the same numbers
as the exact path's up to rounding."""

from __future__ import annotations

import pytest
import torch

from kiln import SamplingParams
from kiln.models import build_model, quantize_model
from tests.models.test_parity import PoisonedCache, random_tokens, run
from tests.tiny_models import TINY_CONFIGS


def model_for(loaded, fmt: str | None, batch_invariant: bool):
    model = build_model(loaded.config)
    model.load_weights(loaded.tensors)
    return quantize_model(model, fmt, batch_invariant)


def ways(model, config, tokens: list[int], other: list[int], page_size: int = 4, codec: str = "none") -> dict[str, torch.Tensor]:
    """The logits of every position of `tokens`, computed four ways."""
    n = len(tokens)
    paged = lambda: PoisonedCache(model, config, page_size, n + len(other), batch_invariant=True, codec=codec)  # noqa: E731
    uneven = [5, 1, 3, 2, n - 11]
    return {
        "one shot": run(paged(), {0: tokens}, [{0: n}])[0],
        "token by token": run(paged(), {0: tokens}, [{0: 1}] * n)[0],
        "uneven chunks": run(paged(), {0: tokens}, [{0: c} for c in uneven])[0],
        "batched": run(paged(), {1: other, 0: tokens}, [{1: 7, 0: 4}, {0: n - 4, 1: 2}, {1: len(other) - 9}])[0],
    }


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
@pytest.mark.parametrize("fmt", [None, "int8"])
def test_logits_are_bit_identical_however_computed(tiny_loaded, arch: str, fmt: str | None) -> None:
    loaded = tiny_loaded(arch)
    tokens, other = random_tokens(26, seed=3), random_tokens(19, seed=4)
    results = ways(model_for(loaded, fmt, batch_invariant=True), loaded.config, tokens, other)
    reference = results.pop("one shot")
    for name, logits in results.items():
        assert torch.equal(logits, reference), f"{name} differs from one shot by {(logits - reference).abs().max()}"
    exact = run(PoisonedCache(model_for(loaded, fmt, False), loaded.config, 4, 26), {0: tokens}, [{0: 26}])[0]
    # The same arithmetic, reordered; with int8, a reordered sum upstream can move a linear layer's input
    # across one of its int16 rounding boundaries (steps of its row's max|x| / 32,767 at these widths),
    # hence the looser bound.
    bound = 1e-4 if fmt is None else 1e-3
    assert torch.allclose(reference, exact, rtol=bound, atol=bound)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_long_histories_split_into_key_chunks_stay_bit_identical(tiny_loaded, arch: str) -> None:
    """Past 256 positions the attention kernel cuts a query's keys into chunks merged in order: one row's
    chunks run as parallel tasks (decode), many rows' chunks one after another; same arithmetic."""
    loaded = tiny_loaded(arch)
    tokens, other = random_tokens(600, seed=7), random_tokens(19, seed=8)
    results = ways(model_for(loaded, None, batch_invariant=True), loaded.config, tokens, other, page_size=16)
    reference = results.pop("one shot")
    for name, logits in results.items():
        assert torch.equal(logits, reference), f"{name} differs from one shot by {(logits - reference).abs().max()}"
    exact = run(PoisonedCache(model_for(loaded, None, False), loaded.config, 16, 600), {0: tokens}, [{0: 600}])[0]
    assert torch.allclose(reference, exact, rtol=1e-4, atol=1e-4)


def test_engine_tokens_and_logprobs_do_not_depend_on_batch_or_chunking(tiny_llm) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
    prompt = random_tokens(40, seed=5)
    alone = tiny_llm("gemma3", deterministic=True).generate(prompt, params)[0]
    chunked = tiny_llm("gemma3", deterministic=True, prefill_chunk_tokens=7, speculative=None).generate(prompt, params)[0]
    batch = [random_tokens(30 + i, seed=6 + i) for i in range(3)]
    batched = tiny_llm("gemma3", deterministic=True).generate([*batch[:2], prompt, batch[2]], params)[2]
    assert alone.logprobs is not None and len(alone.logprobs) == 12
    for other in (chunked, batched):
        assert other.token_ids == alone.token_ids
        assert other.logprobs == alone.logprobs  # floats compared exactly


@pytest.mark.embedded
def test_embedded_model_logits_are_bit_identical_however_computed() -> None:
    from kiln.models.loader import load_model

    loaded = load_model()
    tokens = loaded.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    other = loaded.tokenizer.encode("def fibonacci(n):\n    return n")
    results = ways(model_for(loaded, "int8", batch_invariant=True), loaded.config, tokens, other, page_size=16)
    reference = results.pop("one shot")
    for name, logits in results.items():
        assert torch.equal(logits, reference), f"{name} differs from one shot by {(logits - reference).abs().max()}"


@pytest.mark.parametrize("arch", list(TINY_CONFIGS))
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_coded_pages_stay_bit_identical_however_computed(tiny_loaded, arch: str, codec: str) -> None:
    """Pages stored as int8 / int4 codes: a token is encoded on its own when written and the kernel
    dequantises as it reads, so the guarantee holds; the gathered path reads the same values, and the
    logits stay near those of the exact pool."""
    loaded = tiny_loaded(arch)
    tokens, other = random_tokens(40, seed=5), random_tokens(19, seed=6)
    model = model_for(loaded, None, batch_invariant=True)
    results = ways(model, loaded.config, tokens, other, codec=codec)
    reference = results.pop("one shot")
    for name, logits in results.items():
        assert torch.equal(logits, reference), f"{name} differs from one shot by {(logits - reference).abs().max()}"
    gathered = run(PoisonedCache(model_for(loaded, None, False), loaded.config, 4, 40, codec=codec), {0: tokens}, [{0: 40}])[0]
    exact = ways(model, loaded.config, tokens, other, codec="none")["one shot"]
    # The gathered path rounds differently upstream; a K/V value on a rounding boundary may then take the
    # next code (one step: 1/127 of its row's largest value, 1/7 in int4), hence not 1e-6 (measured up to
    # 8e-4 in int8, 5e-3 in int4 on the tiny Phi-3).
    assert relative(gathered, reference) < {"int8": 1e-3, "int4": 1e-2}[codec]
    error = relative(reference, exact)
    # Measured up to 0.005 / 0.072 here on dense models. A mixture of experts may route a token whose K/V
    # rounded differently to other experts (0.101 with int4 on the tiny Qwen3-MoE).
    bound = {"int8": 0.01, "int4": 0.1}[codec] * (1.5 if loaded.config.moe else 1.0)
    assert 0 < error < bound, error


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
