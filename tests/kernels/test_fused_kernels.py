"""The small fused kernels a decode step calls per layer (kernels/norms.cpp residual_norm,
kernels/activations.cpp, kernels/argmax.cpp) against the torch ops they replace: the residual add + norm
bit for bit, the gated activations to float rounding (and no worse than torch against float64), argmax
exactly, ties, NaN and infinities included. Model-level agreement is test_parity.py's (fused and op-by-op
engines against transformers)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.engine.sampler import argmax
from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from kiln.models.layers import RMSNorm, add_normed

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels need AVX2 and a C++ compiler")


def norm(width: int, offset: bool, seed: int) -> RMSNorm:
    module = RMSNorm((width,), 1e-6, offset)
    with torch.no_grad():
        module.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(seed)))
    return module


@pytest.mark.parametrize("offset", [True, False])
@pytest.mark.parametrize("normed", ["both", "sum only", "input only"])
def test_residual_norm_equals_the_norm_then_add_path(offset, normed):
    x, y = torch.randn(2, 5, 64), torch.randn(2, 5, 64) * 30
    y_norm = None if normed == "sum only" else norm(64, offset, 1)
    out_norm = None if normed == "input only" else norm(64, offset, 2)
    for module in (y_norm, out_norm):
        if module is not None:
            module.fused = True
    expected = x + (y if y_norm is None else y_norm(y))
    total, next_input = add_normed(x, y, y_norm, out_norm)
    assert torch.equal(total, expected)
    if out_norm is None:
        assert next_input is None
    else:
        assert torch.equal(next_input, out_norm(expected))


def test_each_norm_keeps_its_own_eps_and_offset():
    y_norm, out_norm = norm(64, True, 1), norm(64, False, 2)
    out_norm.eps = 1e-1
    x, y = torch.randn(3, 64), torch.randn(3, 64) * 0.1
    y_norm.fused = out_norm.fused = True  # the two-call path: rms_norm's kernel, then an add
    expected = x + y_norm(y), out_norm(x + y_norm(y))
    total, next_input = add_normed(x, y, y_norm, out_norm)
    assert torch.equal(total, expected[0]) and torch.equal(next_input, expected[1])


def test_residual_norm_refuses_mismatched_inputs():
    with pytest.raises(InvariantViolation, match="same shape"):
        kernels().residual_norm(torch.randn(2, 64), torch.randn(3, 64), None, 0.0, 0.0, None, 0.0, 0.0)
    with pytest.raises(InvariantViolation, match="features"):
        kernels().residual_norm(torch.randn(2, 64), torch.randn(2, 64), torch.ones(32), 1e-6, 0.0, None, 0.0, 0.0)


@pytest.mark.parametrize("activation, reference", [
    ("silu", F.silu),
    ("gelu_pytorch_tanh", lambda x: F.gelu(x, approximate="tanh")),
])
@pytest.mark.parametrize("width", [2048, 21])  # 21: a tail past the last full 8 lanes
def test_gated_activation_matches_torch(activation, reference, width):
    gate_up = torch.randn(3, 2 * width) * 6
    gate_up[0, :5] = torch.tensor([0.0, -0.0, 90.0, -90.0, 1e-30])
    gate, up = gate_up.chunk(2, dim=-1)
    got = kernels().gated_activation(gate_up, activation)
    expected = reference(gate) * up
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-5)  # torch rounds 1 + tanh(u) to 0 sooner
    exact = reference(gate.double()) * up.double()
    assert (got.double() - exact).abs().max() <= 2 * (expected.double() - exact).abs().max() + 1e-7


def test_gated_activation_refuses_unknown_activations():
    with pytest.raises(InvariantViolation, match="activation"):
        kernels().gated_activation(torch.randn(2, 16), "relu")


@pytest.mark.parametrize("vocab", [262144, 4099, 5, 1])
def test_argmax_is_torchs(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    last = vocab - 1
    logits[1, last] = logits[1].max() + 1  # the maximum in the last lane of the last piece
    logits[2] = 0.5  # all tied: the first index
    logits[3, last // 2] = logits[3, last] = logits[3].max() + 2  # tie between two pieces
    logits[4] = float("-inf")
    logits[5, last // 3] = logits[5, last] = float("nan")  # the first NaN wins
    logits[5, 0] = float("inf")
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(kernels().argmax_rows(logits[:, :vocab]), logits.argmax(dim=-1))


def test_argmax_of_a_strided_view_and_bad_input():
    logits = torch.randn(4, 300)[:, 7:290]
    assert torch.equal(kernels().argmax_rows(logits), logits.argmax(dim=-1))
    with pytest.raises(InvariantViolation, match="float32"):
        kernels().argmax_rows(torch.zeros(2, 8, dtype=torch.float64))
