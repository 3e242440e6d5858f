"""The sampler at the edges of its parameter ranges: nothing a valid SamplingParams allows may fail."""

import pytest
import torch

from kiln import SamplingParams
from kiln.engine.sampler import Sampler
from kiln.errors import InvalidArgumentError


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 30


@pytest.mark.parametrize("temperature", [1e-300, 1e-39, 1e-6, 2e-5])
def test_a_tiny_temperature_picks_the_argmax(logits, temperature):
    params = [SamplingParams(temperature=temperature, seed=1)] * 3
    chosen, _ = Sampler().sample(logits, params, [1, 2, 3])
    assert chosen == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 1e-3])
def test_a_tiny_top_p_keeps_the_likeliest_token(logits, top_p):
    params = [SamplingParams(temperature=1.0, top_p=top_p, seed=1)] * 3
    chosen, _ = Sampler().sample(logits, params, [1, 2, 3])
    assert chosen == logits.argmax(dim=-1).tolist()


def test_a_hot_temperature_still_samples_valid_ids(logits):
    chosen, logprobs = Sampler().sample(logits, [SamplingParams(temperature=100.0, seed=3, logprobs=True)] * 3, [1, 2, 3])
    assert all(0 <= token < 1000 for token in chosen) and logprobs is not None and all(lp <= 0 for lp in logprobs)


@pytest.mark.parametrize(("overrides", "complaint"), [
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": None}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": "high"}, "top_p"),
    ({"max_tokens": True}, "max_tokens"),
    ({"top_k": 2.0}, "top_k"),
    ({"stop": None}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ["x"] * 17}, "at most 16 stop strings"),
    ({"stop": ["x" * 257]}, "at most 16 stop strings"),
    ({"stop_token_ids": ("a",)}, "stop_token_ids"),
    ({"logprobs": "yes"}, "booleans"),
])
def test_bad_sampling_params_are_invalid_arguments(overrides, complaint):
    with pytest.raises(InvalidArgumentError, match=complaint):
        SamplingParams(**overrides)


def test_edge_values_inside_the_ranges_are_accepted():
    SamplingParams(seed=2**64 - 1, temperature=100, top_p=1e-300, stop="x", stop_token_ids=[3])
    SamplingParams(seed=-(2**63), stop=["y" * 256] * 16)
