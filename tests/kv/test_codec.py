"""KV codecs round-trip within their stated error, cost the bytes they claim, and decode one slot alone."""

import pytest
import torch

from kiln.errors import InvalidArgumentError
from kiln.kv.codec import KVCodec
from kiln.kv.layout import KVLayout

LAYOUT = KVLayout(groups=(), slots=3, page_size=16, num_kv_heads=2, head_dim=64)


def page(seed: int = 0) -> torch.Tensor:
    """A page with an outlier key channel and a zero row, as real keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 16, 2, 64, generator=g) * 3
    x[0, :, :, :, 5] += 40.0
    x[1, 2, 4] = 0.0
    return x


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_round_trip_within_the_stated_bound(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    x = page()
    y = codec.decode(codec.encode(x))
    for kind in range(2):
        for slot in range(3):
            error = (y[kind, slot] - x[kind, slot]).abs()
            assert (error <= codec.max_error(x[kind, slot], kind)).all()
            assert error.max() > 0  # lossy: the bound is not vacuous
    assert y[1, 2, 4].eq(0).all()  # an all-zero row stays zero (no NaN from a zero scale)


def test_int4_keys_per_channel_keep_an_outlier_channel_from_swamping_the_rest():
    codec = KVCodec("int4", LAYOUT, torch.float32)
    x = page()
    y = codec.decode(codec.encode(x))
    other = (y[0, :, :, :, 6] - x[0, :, :, :, 6]).abs().max()
    assert other < 1.5  # per-token scales would be set by the +40 outlier: steps of ~3
    relative = ((y - x).norm() / x.norm()).item()
    assert relative < 0.1


def test_none_is_bit_exact_and_sizes_are_what_they_claim():
    raw = KVCodec("none", LAYOUT, torch.float32)
    x = page()
    assert torch.equal(raw.decode(raw.encode(x)), x)
    assert raw.bytes_per_token() == 2 * 3 * 2 * 64 * 4
    int8, int4 = KVCodec("int8", LAYOUT, torch.float32), KVCodec("int4", LAYOUT, torch.float32)
    assert int8.bytes_per_token() == 2 * 3 * 2 * (64 + 2)  # a float16 scale per token and head
    assert int4.bytes_per_token() < raw.bytes_per_token() / 5  # 4-bit codes plus scales and zero points
    for codec in (raw, int8, int4):
        assert codec.encode(x).numel() == codec.page_nbytes


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_one_slot_decodes_alone(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    data = codec.encode(page())
    whole = codec.decode(data)
    k, v = codec.decode_slot(data, 1)
    assert torch.equal(k, whole[0, 1]) and torch.equal(v, whole[1, 1])


def test_unknown_codec_is_refused():
    with pytest.raises(InvalidArgumentError, match="kv_codec") as raised:
        KVCodec("zstd", LAYOUT, torch.float32)
    assert raised.value.param == "kv_codec"
