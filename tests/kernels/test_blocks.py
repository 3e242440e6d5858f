"""kernels/blocks.cpp: linear layers over GGUF's quantised blocks as stored, against gguf-py's dequantisation
of the same bytes, on both instruction-set paths.

Blocks come from two places: ggml's own quantisation of seeded rows (tests/fixtures/gguf_types, every block
type), and random bytes with sane scales (any bit pattern of the codes is a valid block), which reach every
code value and sign. Two references: the dequantised weights against the input as given, within the input's
rounding (each value moves by at most half its block's step), and against the input rounded as the kernel
rounds it (half to even), within float error: the second catches a decoding mistake that
the first's slack could hide. Inputs are rounded per 32 values against the 32-value formats and per 256
against the K-quants and IQ4_XS, as llama.cpp's dot products round them."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from kiln.models.gguf_blocks import BLOCK_TYPES

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run on this machine")

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "gguf_types" / "ggml_rows.json").read_text())
TYPES = sorted(t.name for t in BLOCK_TYPES)
# Where each type keeps its float16 scales (d, and a minimum where it has one): random bytes there would
# make infinities and NaNs, which no quantiser writes.
SCALE_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
                 "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
PATHS = ["avx2", "avx512_vnni"]


def random_blocks(name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of random blocks of type `name` whose scales are small normal float16 values."""
    qtype = gguf.GGMLQuantizationType[name]
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    generator = np.random.default_rng(seed)
    raw = generator.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[name]:
        scales = (generator.standard_normal((rows, cols // values)) * 0.01).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def input_block(name: str) -> int:
    """Values per input scale the kernel uses against weights of type `name`: llama.cpp's Q8_K blocks of 256
    for the 256-value formats, its Q8_0 blocks of 32 for the others."""
    return 256 if gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0] == 256 else 32


def rounded_like_the_kernel(x: np.ndarray, per: int = 32) -> np.ndarray:
    """x with each block of `per` values rounded to 127 levels of its own max |x| (half to even)."""
    blocks = x.reshape(x.shape[0], -1, per).astype(np.float32)
    scale = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    codes = np.round(blocks * inverse)
    return (codes * scale).reshape(x.shape)


def input_rounding(x: np.ndarray, weight: np.ndarray, per: int) -> np.ndarray:
    """[M, N]: the most rounding x per block of `per` values can move each output: sum |w| * step / 2."""
    step = np.abs(x.reshape(x.shape[0], -1, per)).max(axis=2) / 127
    return (np.repeat(step, per, axis=1) / 2) @ np.abs(weight.T)


def linear(x: torch.Tensor, raw: np.ndarray, name: str, columns: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel over `raw` (one tensor's rows, stored at an offset as in a file)."""
    data = torch.from_numpy(np.concatenate([np.zeros(64, np.uint8), raw.ravel()]))
    segments = torch.tensor([[64, raw.shape[0], int(gguf.GGMLQuantizationType[name])]])
    return kernels().linear_blocks(x, data, segments, columns, bias, raw.shape[0])


Q4_KX8 = 1000 + int(gguf.GGMLQuantizationType.Q4_K)  # blocks.h's kRepacked + Q4_K


def repacked_linear(x: torch.Tensor, raw: np.ndarray, name: str) -> torch.Tensor:
    """The kernel over rows of `name` repacked eight to a group (blocks.h's kRepacked), as a layer loads them."""
    qtype = int(gguf.GGMLQuantizationType[name])
    cols = x.shape[-1]
    data = torch.empty(raw.shape[0] * kernels().repacked_row_bytes(qtype, cols), dtype=torch.uint8)
    segments = torch.tensor([[0, raw.shape[0], kernels().repack_blocks(torch.from_numpy(raw), qtype, data)]])
    return kernels().linear_blocks(x, data, segments, None, None, raw.shape[0])


# Each layout with the rows its tests use: as stored (any count), repacked (whole groups of eight).
LAYOUTS = {"stored": (linear, 19), "repacked": (repacked_linear, 24)}


def check_against_reference(x: np.ndarray, raw: np.ndarray, name: str, out: np.ndarray) -> None:
    weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).astype(np.float64)
    scale = np.abs(x.astype(np.float64)) @ np.abs(weight.T) + 1e-30
    per = input_block(name)
    rounded = rounded_like_the_kernel(x, per).astype(np.float64) @ weight.T
    assert np.all(np.abs(out - rounded) <= 2e-5 * scale), name  # float error only
    exact = x.astype(np.float64) @ weight.T
    assert np.all(np.abs(out - exact) <= input_rounding(x, weight, per) + 2e-5 * scale), name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TYPES)
def test_ggml_quantised_rows_compute_as_their_dequantisation(name: str, layout: str, isa: str) -> None:
    recorded = np.frombuffer(base64.b64decode(FIXTURE["types"][name]["quantized"]), np.uint8).reshape(FIXTURE["rows"], -1)
    compute, _ = LAYOUTS[layout]
    raw = recorded if layout == "stored" else np.concatenate([recorded, recorded, recorded[:2]])  # a group of 8
    x = np.random.default_rng(1).standard_normal((5, FIXTURE["cols"])).astype(np.float32)
    check_against_reference(x, raw, name, compute(torch.from_numpy(x), raw, name).numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("inputs", [1, 2, 3, 4, 7, 70])
def test_random_blocks_compute_as_their_dequantisation(name: str, inputs: int, layout: str, isa: str) -> None:
    compute, rows = LAYOUTS[layout]
    raw = random_blocks(name, rows, 512, seed=inputs)
    x = np.random.default_rng(inputs).standard_normal((inputs, 512)).astype(np.float32)
    x[:, :32] *= 50  # an outlier block: each block's scale is its own
    x[-1, 64:96] = 0  # an all-zero block
    check_against_reference(x, raw, name, compute(torch.from_numpy(x), raw, name).numpy())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", TYPES)
def test_both_paths_give_the_same_bits_and_a_row_its_own_result_in_any_batch(name: str, layout: str) -> None:
    compute, _ = LAYOUTS[layout]
    raw = random_blocks(name, 24, 256, seed=3)
    x = torch.randn(9, 256)
    results = []
    for path in PATHS if kernels().cpu_has_avx512_vnni() else PATHS[:1]:
        previous = kernels().use_isa(path)
        try:
            results.append(compute(x, raw, name))
            alone = [compute(x[i : i + 1], raw, name) for i in range(9)]
        finally:
            kernels().use_isa(previous)
        assert torch.equal(torch.cat(alone), results[-1])
    assert all(torch.equal(result, results[0]) for result in results)


def test_a_fused_layer_of_several_types_puts_reordered_rows_back_and_adds_its_bias() -> None:
    parts = [("Q4_K", 8), ("Q6_K", 4), ("Q8_0", 6)]
    raws = [random_blocks(name, rows, 256, seed=i) for i, (name, rows) in enumerate(parts)]
    data = torch.from_numpy(np.concatenate([np.zeros(16, np.uint8), *(raw.ravel() for raw in raws)]))
    offsets = np.cumsum([16, *(raw.nbytes for raw in raws)])[:-1]
    segments = torch.tensor([[int(offset), rows, int(gguf.GGMLQuantizationType[name])]
                             for offset, (name, rows) in zip(offsets, parts, strict=True)])
    columns = torch.randperm(18)
    bias = torch.randn(18)
    x = torch.randn(3, 256)
    out = kernels().linear_blocks(x, data, segments, columns, bias, 18)

    stored = torch.cat([linear(x, raw, name) for raw, (name, _) in zip(raws, parts, strict=True)], dim=1)
    expected = torch.empty_like(stored)
    expected[:, columns] = stored
    torch.testing.assert_close(out, expected + bias, rtol=0, atol=1e-6)


def test_a_nan_input_gives_nan_outputs_for_its_row_only() -> None:
    raw = random_blocks("Q4_K", 8, 256, seed=0)
    x = torch.randn(2, 256)
    x[1, 5] = float("nan")
    out = linear(x, raw, "Q4_K")
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([[64, 4, 2]], "segments hold 4 rows"),  # the layer has 8
        ([[64, 8, 10]], "GGML type 10"),  # Q2_K: not computed here
        ([[64, 8, 0]], "GGML type 0"),  # F32
        ([[600, 8, 2]], "lie outside"),
        ([[-1, 8, 2]], "lie outside"),
        ([[64, 4, 2], [64, 5, 2]], "segments hold 9 rows"),
    ],
)
def test_segments_outside_the_data_or_of_other_types_are_refused(segments: list[list[int]], message: str) -> None:
    data = torch.zeros(64 + 8 * 8 * 18, dtype=torch.uint8)  # 8 rows of 256 Q4_0 values
    with pytest.raises(InvariantViolation, match=message):
        kernels().linear_blocks(torch.randn(1, 256), data, torch.tensor(segments), None, None, 8)


def test_widths_that_are_not_whole_blocks_and_bad_column_maps_are_refused() -> None:
    raw = random_blocks("Q4_K", 8, 256, seed=0)
    with pytest.raises(InvariantViolation, match="not whole blocks of 256"):
        linear(torch.randn(1, 288), raw[:, :162], "Q4_K")  # 288 = 9 x 32, not a multiple of 256
    with pytest.raises(InvariantViolation, match="multiple of 32"):
        linear(torch.randn(1, 250), raw, "Q4_K")
    with pytest.raises(InvariantViolation, match="columns"):
        linear(torch.randn(1, 256), raw, "Q4_K", columns=torch.tensor([0, 1, 2, 3, 4, 5, 6, 8]))


def test_an_unknown_or_missing_instruction_set_is_refused() -> None:
    with pytest.raises(InvariantViolation, match="unknown instruction set"):
        kernels().use_isa("sse2")
    assert kernels().isa() in PATHS


@pytest.mark.parametrize(("segments", "rows", "message"), [
    ([[0, 4, Q4_KX8], [4736, 4, Q4_KX8]], 8, "groups of 8"),  # half a group each
    ([[0, 4, 12], [576, 8, Q4_KX8]], 12, "from row 4"),  # a whole group, after 4 rows of another part
])
def test_repacked_segments_off_their_groups_are_refused(segments: list[list[int]], rows: int, message: str) -> None:
    data = torch.zeros(16 * 1184, dtype=torch.uint8)
    with pytest.raises(InvariantViolation, match=message):
        kernels().linear_blocks(torch.randn(1, 256), data, torch.tensor(segments), None, None, rows)


def test_repacking_refuses_rows_off_their_groups_and_a_wrong_size() -> None:
    raw = torch.from_numpy(random_blocks("Q4_0", 12, 256, seed=0))
    with pytest.raises(InvariantViolation, match="groups of 8"):
        kernels().repack_blocks(raw, 2, torch.empty(12 * 144, dtype=torch.uint8))
    with pytest.raises(InvariantViolation, match="out: contiguous uint8 of 1152 bytes"):
        kernels().repack_blocks(raw[:8], 2, torch.empty(1000, dtype=torch.uint8))
    assert kernels().repacked_row_bytes(10, 256) == 0  # Q2_K: not computed here
    assert kernels().repacked_row_bytes(12, 512) == 2 * 148  # Q4_K: its scales unpacked
