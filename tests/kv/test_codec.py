"""KV codecs round-trip within their stated error, cost the bytes they claim, encode a token alone (the pool
writes them one at a time) and decode any pages of a stack."""

import pytest
import torch

from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels
from kiln.kernels import supported as kernels_supported
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


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_an_outlier_channel_costs_only_its_own_group(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    x = page()
    y = codec.decode(codec.encode(x))
    same_group = (y[0, :, :, :, 6] - x[0, :, :, :, 6]).abs().max()  # channel 5's group: steps set by the +40
    other_group = (y[0, :, :, :, 40] - x[0, :, :, :, 40]).abs().max()
    assert other_group < same_group / 2


def test_int4_keeps_keys_8_bit_and_codes_values_in_4_bits():
    int8, int4 = KVCodec("int8", LAYOUT, torch.float32), KVCodec("int4", LAYOUT, torch.float32)
    x = page()
    y8, y4 = int8.decode(int8.encode(x)), int4.decode(int4.encode(x))
    assert torch.equal(y4[0], y8[0])  # keys: the same 8-bit codes
    relative = ((y4[1] - x[1]).norm() / x[1].norm()).item()
    assert 0.02 < relative < 0.15  # 15 steps over ~6 sigma: RMS error step / sqrt(12), about a tenth of the spread


def test_none_is_bit_exact_and_sizes_are_what_they_claim():
    raw = KVCodec("none", LAYOUT, torch.float32)
    x = page()
    assert torch.equal(raw.decode(raw.encode(x)), x)
    assert raw.bytes_per_token() == 2 * 3 * 2 * 64 * 4
    int8, int4 = KVCodec("int8", LAYOUT, torch.float32), KVCodec("int4", LAYOUT, torch.float32)
    assert int8.bytes_per_token() == 2 * 3 * 2 * (64 + 2 * 2)  # a float16 scale per 32 channels
    assert int4.bytes_per_token() == 3 * 2 * (64 + 2 * 2) + 3 * 2 * (32 + 2 * 2 * 2)  # 8-bit keys, 4-bit values
    for codec in (raw, int8, int4):
        assert codec.encode(x).numel() == codec.page_nbytes


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_tokens_written_one_at_a_time_give_the_page_encoded_at_once(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    x = page()
    pool = torch.zeros(3, codec.page_nbytes, dtype=torch.uint8)
    for offset in torch.randperm(16).tolist():  # any order: a token's bytes depend on that token only
        index = (torch.tensor([1]), torch.tensor([offset]))
        for kind in range(2):
            for slot in range(3):
                codec.store(codec.segment(pool, kind, slot), kind, index, x[kind, slot, offset][None])
    assert torch.equal(pool[1], codec.encode(x)) and pool[[0, 2]].eq(0).all()


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_load_decodes_the_selected_pages_of_a_stack(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    pages = [page(seed) for seed in range(3)]
    stack = torch.stack([codec.encode(p) for p in pages])
    out = torch.empty(2, 16, 2, 64)
    codec.load(codec.segment(stack, 1, 2), torch.tensor([2, 0]), out)  # V of slot 2 of pages 2 and 0
    assert torch.equal(out[0], codec.decode(stack[2])[1, 2]) and torch.equal(out[1], codec.decode(stack[0])[1, 2])


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
def test_clear_from_zeroes_the_later_positions_only(name):
    codec = KVCodec(name, LAYOUT, torch.float32)
    x = page()
    data = codec.encode(x)
    codec.clear_from(data, 5)
    y = codec.decode(data)
    assert y[:, :, 5:].eq(0).all() and torch.equal(y[:, :, :5], codec.decode(codec.encode(x))[:, :, :5])


def test_unknown_codec_is_refused():
    with pytest.raises(InvalidArgumentError, match="kv_codec") as raised:
        KVCodec("zstd", LAYOUT, torch.float32)
    assert raised.value.param == "kv_codec"


@pytest.mark.skipif(not kernels_supported(), reason="Kiln's CPU kernels need AVX2 and a C++ compiler")
@pytest.mark.parametrize("name,dtype", [("none", torch.float32), ("none", torch.float16), ("int8", torch.float32), ("int4", torch.float32)])
def test_the_store_kernel_writes_the_torch_encodings_bytes(name, dtype):
    """kernels/kv_store.cpp stores rows as the codec's torch path does, byte for byte (raw float32 pages, raw
    float16 ones rounded as .half() rounds, overflow and ties included, and codes with zero rows and values
    below a float16 step), into scattered (page, offset) places of a pool's views."""
    codec = KVCodec(name, LAYOUT, dtype)
    gen = torch.Generator().manual_seed(0)
    places = torch.randperm(5 * 16, generator=gen)[:40]
    pages, offsets = places // 16, places % 16
    torch_pool, kernel_pool = (torch.zeros(5, codec.page_nbytes, dtype=torch.uint8) for _ in range(2))
    for kind in range(2):
        x = torch.randn(40, 2, 64, generator=gen) * torch.rand(40, 2, 1, generator=gen) * 5
        x[3], x[4, 0, :32] = 0.0, 1e-9
        x[5, 0, :4] = torch.tensor([1e5, -7e4, 1 + 2**-11, 1 + 3 * 2**-11])  # beyond float16, and ties to even
        codec.store(codec.segment(torch_pool, kind, 1), kind, (pages, offsets), x)
        target = codec.segment(kernel_pool, kind, 1)
        kernels().store_kv(x, *target.kernel_parts(), pages, offsets)
    assert torch.equal(kernel_pool, torch_pool) and torch_pool.any()
