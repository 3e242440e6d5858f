"""How a step's layers attend (kiln/models/attention.py): the backend chosen once per step from the platform and
the step's shape, and the two backends computing the same attention."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import supported
from kiln.models.attention import IN_PLACE_MAX_ROWS, AttentionBatch, GatheredAttention, InPlaceAttention
from tests.models.test_parity import ATOL, PoisonedCache, make_pair, random_tokens, run
from tests.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run on this machine")


def test_the_backend_is_chosen_from_the_platform_and_the_step() -> None:
    kv = object()  # the choice reads only the lengths
    assert isinstance(AttentionBatch.for_lengths([1, IN_PLACE_MAX_ROWS], kv, kernel_attention=True).backend, InPlaceAttention)  # type: ignore[arg-type]
    assert isinstance(AttentionBatch.for_lengths([IN_PLACE_MAX_ROWS + 1], kv, kernel_attention=True).backend, GatheredAttention)  # type: ignore[arg-type]
    assert isinstance(AttentionBatch.for_lengths([500], kv, batch_invariant=True).backend, InPlaceAttention)  # type: ignore[arg-type]
    assert isinstance(AttentionBatch.for_lengths([1], kv).backend, GatheredAttention)  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])  # sliding and full layers, biases; four norms a block
def test_both_backends_attend_alike(arch: str) -> None:
    """The same steps (appends beside decode rows, across pages and windows), in place and gathered: the logits
    agree to float rounding (the two sum in different orders)."""
    pair = make_pair(TINY_CONFIGS[arch], fused=False)
    tokens = {0: random_tokens(30, seed=1), 1: random_tokens(20, seed=2)}
    steps = [{0: 9}, {0: 5, 1: 7}] + [{0: 1, 1: 1}] * 8 + [{0: 8, 1: 5}]
    outputs = []
    for in_place in (True, False):
        paged = PoisonedCache(pair.ours, pair.config, 4, 60)
        paged.runner.kernel_attention = in_place
        outputs.append(run(paged, tokens, steps))
    for seq in tokens:
        diff = (outputs[0][seq] - outputs[1][seq]).abs().max().item()
        assert diff <= ATOL, f"sequence {seq}: {diff:.3g}"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # full layers; sliding ones a long prompt outgrows
def test_a_fresh_prompt_attends_causally_over_its_own_keys_as_over_its_pages(arch: str, monkeypatch) -> None:
    """A GPU's prefill of a new prompt (flash_prompt): SDPA's causal attention over the layer's new keys, no
    gather and no mask, gives the gathered path's logits; layers whose window the prompt outgrows, later chunks
    and coded pages keep the gathered path."""
    config = TINY_CONFIGS[arch]
    pair = make_pair(config, fused=False)
    causal = []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kw: causal.append(kw.get("is_causal", False)) or original(*args, **kw))
    tokens = {0: random_tokens(40, seed=3)}
    steps = [{0: 30}, {0: 10}]
    outputs = []
    for flash in (True, False):
        paged = PoisonedCache(pair.ours, pair.config, 4, 60)
        paged.runner.kernel_attention = False
        paged.runner.flash_prompt = flash
        outputs.append(run(paged, tokens, steps)[0])
    assert (outputs[0] - outputs[1]).abs().max().item() <= ATOL
    windows = [config.window_of(layer) for layer in range(config.num_layers)]
    fits = sum(window is None or window >= 30 for window in windows)
    assert causal.count(True) == fits  # the first chunk's layers that it fits; none of the second chunk's
    causal.clear()
    paged = PoisonedCache(pair.ours, pair.config, 4, 60, codec="int8")
    paged.runner.kernel_attention, paged.runner.flash_prompt = False, True
    run(paged, tokens, steps)
    assert True not in causal
