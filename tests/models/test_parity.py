"""Kiln's model definitions agree with transformers (fp32, eager attention) within 1e-4 on every logit
when run as the engine runs them: through the real KVCache (small shuffled pages, sliding-window pages
released by `commit`) and ModelRunner, one-shot, chunked, token by token, in mixed prefill/decode
batches, from a prefix-cache hit and past Gemma's 512-token window; plus the config.json mapping both
ways."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from itertools import zip_longest

import pytest
import torch
from transformers import AutoConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kiln.engine.runner import Chunk, ModelRunner
from kiln.engine.sequence import Sequence
from kiln.errors import InvalidArgumentError
from kiln.kernels import supported as kernels_supported
from kiln.kv.cache import KVCache
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat, dtype_name
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable
from kiln.models import build_model
from kiln.models.causal_lm import CausalLM
from kiln.models.config import ModelConfig, MoEConfig, RopeScaling
from kiln.models.hf_config import config_from_hf, hf_config_dict
from kiln.models.layers import RotaryEmbedding
from kiln.models.moe import SparseMoE
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, random_hf_model, tiny_hf_model

ATOL = 1e-4
# KILN_TEST_DEVICE=cuda runs the engine-path parity tests on a GPU (both models and the KV cache there).
DEVICE = os.environ.get("KILN_TEST_DEVICE", "cpu")
POISON = 0xFF  # every byte: NaN as float32, bfloat16 and float16 (a coded page's scales)
# 660 tokens: prefill chunks that cross position 512 and many page boundaries, then decode steps.
LONG_CHUNKS = [211, 190, 137, 102] + [1] * 20


@dataclasses.dataclass
class Pair:
    """A tiny transformers model and Kiln's model loaded from its state dict."""

    config: ModelConfig
    hf: PreTrainedModel
    ours: CausalLM

    def reference(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] logits of one full causal forward in transformers."""
        with torch.no_grad():
            return self.hf(input_ids=torch.tensor([tokens], device=DEVICE)).logits[0]


# Engines on a CPU with Kiln's kernels compute norms and RoPE with fused kernels (CausalLM.use_kernels);
# elsewhere, op by op. Both paths are held to the same tolerance.
FUSED = [False, True] if DEVICE == "cpu" and kernels_supported() else [False]


def make_pair(config: ModelConfig, fused: bool = FUSED[-1]) -> Pair:
    hf = random_hf_model(config)
    ours = build_model(config, device=DEVICE)
    ours.load_weights(hf_state_dict(hf))
    if fused:
        ours.use_kernels()
    return Pair(config, hf.to(DEVICE), ours)


@pytest.fixture(scope="module", params=[(name, fused) for name in TINY_CONFIGS for fused in FUSED],
                ids=lambda p: f"{p[0]}-{'fused' if p[1] else 'ops'}")
def pair(request: pytest.FixtureRequest) -> Pair:
    name, fused = request.param
    return make_pair(TINY_CONFIGS[name], fused)


WINDOWED_OR_SCALED = [
    name
    for name, c in TINY_CONFIGS.items()
    if c.sliding_window or c.rope_scaling or c.nope_layers or c.rotary_dim or c.attention_multiplier
]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PoisonedCache:
    """The real KVCache and ModelRunner, rigged so that reading a page attention must not read turns
    logits into NaN, even under a mask. The pool (twice what `num_tokens` need) starts as NaN (all bytes
    0xFF: NaN values, NaN scales of a coded page) and hands pages out in shuffled order; a page `ensure`
    hands out gets finite garbage, as a reused page holds; a page `commit` releases (out of a sliding
    window) becomes NaN again and is counted in `released`. `codec` is the pool's KV codec."""

    def __init__(
        self,
        model: CausalLM,
        config: ModelConfig,
        page_size: int,
        num_tokens: int,
        dtype: torch.dtype = torch.float32,
        batch_invariant: bool = False,
        codec: str = "none",
    ) -> None:
        layout = KVLayout.for_model(config, page_size)
        num_pages = 2 * layout.num_groups * (num_tokens // page_size + 1)
        self.codec = KVCodec(codec, layout, dtype)
        kv_format = KVFormat("tiny", dtype_name(dtype), dtype_name(dtype), self.codec.encoding, page_size)
        self.cache = KVCache(layout, num_pages, self.codec, DEVICE, kv_format)
        self.cache.storage.data.fill_(POISON)
        self.block_shape = (2, layout.slots, page_size, layout.num_kv_heads, layout.head_dim)
        self.generator = torch.Generator().manual_seed(0)
        self.cache._free = torch.randperm(num_pages, generator=self.generator).tolist()
        self.runner = ModelRunner(model, self.cache.storage, batch_invariant)
        self.released = 0

    def admit(self, tokens: list[int]) -> Sequence:
        """A sequence over `tokens`, starting from the longest prefix the cache holds."""
        seq = Sequence(tokens, PageTable.empty(self.cache.layout.num_groups))
        seq.num_computed = self.cache.attach(seq.table, tokens)
        return seq

    def step(self, chunks: list[tuple[Sequence, int]]) -> list[torch.Tensor]:
        """One engine step over the next `n` tokens of each sequence (ensure, forward, commit); each
        sequence's logits for every row it was fed, [n, vocab]."""
        data = self.cache.storage.data
        for seq, n in chunks:
            held = set(seq.table.resident())
            assert self.cache.ensure(seq.table, seq.num_computed + n)
            for page in set(seq.table.resident()) - held:
                data[page] = self.codec.encode(torch.randn(self.block_shape, generator=self.generator))
        logits = self.runner.run(self.runner.prepare([Chunk(seq, n, logit_rows=n) for seq, n in chunks]))
        for seq, n in chunks:
            held = set(seq.table.resident())
            seq.num_computed += n
            self.cache.commit(seq.table, seq.tokens, seq.num_computed)
            self.cache.check(seq.table, seq.tokens, seq.num_computed)
            released = sorted(held - set(seq.table.resident()))
            assert all(self.cache.refcount[page] == 0 for page in released)  # now free or cached
            data[released] = POISON
            self.released += len(released)
        return list(logits.split([n for _, n in chunks]))


def run(
    paged: PoisonedCache, tokens: dict[int, list[int]], steps: list[dict[int, int]]
) -> dict[int, torch.Tensor]:
    """Admit each sequence, feed each step's {sequence: new token count}; return each sequence's logits
    for all the positions it was fed, [positions, vocab]. The steps must finish every sequence."""
    seqs = {key: paged.admit(seq_tokens) for key, seq_tokens in tokens.items()}
    parts: dict[int, list[torch.Tensor]] = {key: [] for key in tokens}
    for step in steps:
        for key, part in zip(step, paged.step([(seqs[key], n) for key, n in step.items()]), strict=True):
            parts[key].append(part)
    assert all(seq.num_computed == len(seq.tokens) for seq in seqs.values())
    return {key: torch.cat(chunks) for key, chunks in parts.items()}


def solo(paged: PoisonedCache, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    return run(paged, {0: tokens}, [{0: n} for n in chunks])[0]


def window_released(layout: KVLayout, num_tokens: int) -> int:
    """Pages the sliding-window groups have released once `num_tokens` are committed: those wholly
    before the window of a query at num_tokens - page_size (commit keeps a page of slack for `drop`)."""
    ps = layout.page_size
    return sum(max(0, num_tokens - ps - g.window + 1) // ps for g in layout.groups if g.window is not None)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.cpu() - b.cpu()).abs().max().item()


def test_one_shot_prefill(pair: Pair) -> None:
    tokens = random_tokens(40, seed=1)
    ours = solo(PoisonedCache(pair.ours, pair.config, 16, len(tokens)), tokens, [40])
    assert max_diff(ours, pair.reference(tokens)) <= ATOL


def test_chunked_prefill_irregular_chunks(pair: Pair) -> None:
    tokens = random_tokens(40, seed=2)
    ours = solo(PoisonedCache(pair.ours, pair.config, 4, len(tokens)), tokens, [5, 16, 3, 9, 1, 6])
    assert max_diff(ours, pair.reference(tokens)) <= ATOL


def test_token_by_token_decode_across_pages_and_windows(pair: Pair) -> None:
    tokens = random_tokens(100, seed=3)
    paged = PoisonedCache(pair.ours, pair.config, 4, len(tokens))
    assert max_diff(solo(paged, tokens, [6] + [1] * 94), pair.reference(tokens)) <= ATOL
    # Every window page the run moved past was released (and poisoned) before the run ended.
    assert paged.released == window_released(paged.cache.layout, len(tokens))


def test_mixed_prefill_and_decode_rows_in_one_step(pair: Pair) -> None:
    tokens = {0: random_tokens(45, seed=4), 1: random_tokens(23, seed=5), 2: random_tokens(30, seed=6)}
    plans = {0: [17, 11] + [1] * 17, 1: [5, 1, 1, 9] + [1] * 7, 2: [0, 9, 13] + [1] * 8}
    steps = [
        {seq: n for seq, n in zip(plans, counts, strict=True) if n}
        for counts in zip_longest(*plans.values(), fillvalue=0)
    ]
    assert any(len(step) == 3 and max(step.values()) > 1 for step in steps)  # prefill and decode rows mix
    paged = PoisonedCache(pair.ours, pair.config, 4, sum(map(len, tokens.values())))
    outputs = run(paged, tokens, steps)
    for seq, seq_tokens in tokens.items():
        assert max_diff(outputs[seq], pair.reference(seq_tokens)) <= ATOL, f"sequence {seq}"


def test_prefix_hit_reads_the_cached_pages(pair: Pair) -> None:
    """A sequence sharing a released one's first 38 tokens attaches its cached pages (full and window
    groups alike) for the 36 in whole pages and computes only the rest, yet matches a full forward."""
    first = random_tokens(40, seed=10)
    second = first[:38] + random_tokens(10, seed=11)
    paged = PoisonedCache(pair.ours, pair.config, 4, len(first) + len(second))
    seq = paged.admit(first)
    paged.step([(seq, len(first))])
    paged.cache.release(seq.table)
    ours = run(paged, {0: second}, [{0: 9}, {0: 1}, {0: 1}, {0: 1}])[0]  # 12 tokens: the rest after 36
    assert max_diff(ours, pair.reference(second)[36:]) <= ATOL


def check_long_prompt(pair: Pair) -> None:
    tokens = random_tokens(sum(LONG_CHUNKS), seed=9)
    paged = PoisonedCache(pair.ours, pair.config, 16, len(tokens))
    assert max_diff(solo(paged, tokens, LONG_CHUNKS), pair.reference(tokens)) <= ATOL
    assert paged.released == window_released(paged.cache.layout, len(tokens))


def test_prompt_longer_than_512_tokens(pair: Pair) -> None:
    check_long_prompt(pair)


def test_prompt_longer_than_gemmas_real_window() -> None:
    """Gemma 3's sliding window is 512 tokens: the same weights with that window, so that prefill chunks
    and decode steps straddle the window's edge and release the pages it moves past."""
    check_long_prompt(make_pair(dataclasses.replace(TINY_CONFIGS["gemma3"], sliding_window=512)))


@pytest.mark.parametrize("name", WINDOWED_OR_SCALED)
def test_window_and_rope_scaling_are_exercised(name: str) -> None:
    """The parity tests above can fail: the same weights with a window one wider, without the RoPE
    scaling, with RoPE in SmolLM3's NoPE layers, rotating whole Phi-3 heads or without Granite's attention
    and residual multipliers disagree with transformers far beyond the tolerance."""
    pair = make_pair(TINY_CONFIGS[name])
    variants = []
    if pair.config.sliding_window:
        variants.append(dataclasses.replace(pair.config, sliding_window=pair.config.sliding_window + 1))
    if pair.config.rope_scaling:
        variants.append(dataclasses.replace(pair.config, rope_scaling=None))
    if pair.config.nope_layers:
        variants.append(dataclasses.replace(pair.config, nope_layers=()))
    if pair.config.rotary_dim:  # LongRoPE's factors repeated for the frequencies of whole heads
        scaling = pair.config.rope_scaling
        whole = scaling and dataclasses.replace(scaling, long_factor=scaling.long_factor * 2, short_factor=scaling.short_factor * 2)
        variants.append(dataclasses.replace(pair.config, rotary_dim=None, rope_scaling=whole))
    if pair.config.attention_multiplier:
        variants.append(dataclasses.replace(pair.config, attention_multiplier=None))
        variants.append(dataclasses.replace(pair.config, residual_multiplier=1.0))
    tokens = random_tokens(40, seed=7)
    for config in variants:
        model = build_model(config, device=DEVICE)
        model.load_weights(hf_state_dict(pair.hf))
        ours = solo(PoisonedCache(model, config, 4, len(tokens)), tokens, [40])
        assert max_diff(ours, pair.reference(tokens)) > 1e-2


@pytest.mark.parametrize("name", [name for name, c in TINY_CONFIGS.items() if c.moe])
def test_moe_routing_is_exercised(name: str) -> None:
    """The tokens of one step take different experts, and the parity tests above can fail: the same
    weights routed to one expert fewer, or with the top-k weights renormalised the other way, disagree
    with transformers far beyond the tolerance."""
    pair = make_pair(TINY_CONFIGS[name])
    moe = pair.config.moe
    tokens = random_tokens(40, seed=7)
    sparse = next(block.mlp for block in pair.ours.model.layers if isinstance(block.mlp, SparseMoE))
    experts, _ = sparse.route(pair.ours.model.embed_tokens(torch.tensor(tokens, device=DEVICE)))
    assert len(set(map(tuple, experts.tolist()))) > len(tokens) // 2  # token by token, not one choice
    variants = [
        dataclasses.replace(moe, experts_per_token=moe.experts_per_token - 1),
        dataclasses.replace(moe, norm_topk_prob=not moe.norm_topk_prob),
    ]
    for variant in variants:
        config = dataclasses.replace(pair.config, moe=variant)
        model = build_model(config, device=DEVICE)
        model.load_weights(hf_state_dict(pair.hf))
        ours = solo(PoisonedCache(model, config, 4, len(tokens)), tokens, [40])
        assert max_diff(ours, pair.reference(tokens)) > 1e-2


@pytest.mark.parametrize(
    "config",
    [
        dataclasses.replace(
            TINY_CONFIGS["qwen3_moe"], num_layers=3, layer_types=(), moe=MoEConfig(8, 2, 32, True, mlp_only_layers=(1,))
        ),
        dataclasses.replace(
            TINY_CONFIGS["qwen2_moe"],
            num_layers=4,
            layer_types=(),
            moe=MoEConfig(8, 3, 32, False, 64, decoder_sparse_step=2),
        ),
    ],
    ids=["mlp_only_layers", "decoder_sparse_step"],
)
def test_dense_layers_between_sparse_ones(config: ModelConfig) -> None:
    """transformers' two ways of making a mixture of experts' layer dense (its own intermediate_size)."""
    pair = make_pair(config)
    assert [isinstance(block.mlp, SparseMoE) for block in pair.ours.model.layers] == [
        config.moe.is_sparse(i) for i in range(config.num_layers)
    ] and not all(config.moe.is_sparse(i) for i in range(config.num_layers))
    tokens = random_tokens(40, seed=12)
    ours = solo(PoisonedCache(pair.ours, config, 4, len(tokens)), tokens, [17, 3] + [1] * 20)
    assert max_diff(ours, pair.reference(tokens)) <= ATOL


def test_bfloat16_model_tracks_transformers_in_bfloat16(pair: Pair) -> None:
    """bf16 rounds differently in SDPA and eager attention, so only closeness is asserted; this guards the
    dtype plumbing (norms in fp32, rotary tables and Gemma's embedding scale cast like transformers)."""
    hf = copy.deepcopy(pair.hf).to(torch.bfloat16)
    model = build_model(pair.config, dtype=torch.bfloat16, device=DEVICE)
    model.load_weights(hf_state_dict(hf))
    tokens = random_tokens(40, seed=8)
    ours = solo(PoisonedCache(model, pair.config, 4, len(tokens), dtype=torch.bfloat16), tokens, [13, 27])
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([tokens], device=DEVICE)).logits[0].float()
    assert ours.dtype == torch.float32
    row_errors = (ours.cpu() - reference.cpu()).abs().amax(dim=-1)
    # A mixture of experts picks each token's experts by a top-k, and bf16 rounding may flip a near tie:
    # that row runs another expert. One such row of the 40 is allowed; the rest must track.
    flipped_routes = 1 if pair.config.moe else 0
    assert (row_errors > 0.02 * reference.abs().max().item()).sum().item() <= flipped_routes


def test_load_weights_rejects_missing_unexpected_and_misshapen() -> None:
    model = build_model(TINY_CONFIGS["qwen2"])
    good = hf_state_dict(tiny_hf_model("qwen2"))
    name = "model.layers.1.self_attn.k_proj.bias"
    extra = "model.layers.9.mlp.up_proj.weight"
    cases = [
        ({k: v for k, v in good.items() if k != name}, f"missing {name}"),
        ({**good, extra: good["model.layers.0.mlp.up_proj.weight"]}, f"unexpected {extra}"),
        ({**good, name: good[name][:-1]}, f"{name} has shape (31,), expected (32,)"),
    ]
    for tensors, message in cases:
        with pytest.raises(InvalidArgumentError, match=re.escape(message)):
            model.load_weights(tensors)
    tied = hf_state_dict(tiny_hf_model("gemma3"))
    with pytest.raises(InvalidArgumentError, match="unexpected lm_head.weight"):
        build_model(TINY_CONFIGS["gemma3"]).load_weights(
            {**tied, "lm_head.weight": tied["model.embed_tokens.weight"]}
        )


def test_rotary_tables_grow_on_demand_and_match_transformers() -> None:
    config = TINY_CONFIGS["llama3_rope"]
    rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
    rotary(torch.tensor([0, 7]), torch.float32, 8)
    positions = torch.tensor([3, 4095, 4096, 9000, 70000])
    cos, sin = rotary(positions, torch.float32, 70001)
    hf_rotary = LlamaRotaryEmbedding(AutoConfig.for_model(**hf_config_dict(config)))
    hf_cos, hf_sin = hf_rotary(torch.zeros(1), positions[None])
    half = config.head_dim // 2
    assert (
        max_diff(cos[:, 0], hf_cos[0, :, :half]) <= 1e-6 and max_diff(sin[:, 0], hf_sin[0, :, :half]) <= 1e-6
    )
    assert torch.equal(hf_cos[0, :, :half], hf_cos[0, :, half:])  # the half tables lose nothing


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_hf_config_round_trip(name: str) -> None:
    config = TINY_CONFIGS[name]
    as_dict = hf_config_dict(config)
    assert config_from_hf(as_dict) == config
    # transformers accepts the dict and its own serialisation maps back to the same config.
    assert config_from_hf(AutoConfig.for_model(**as_dict).to_dict()) == config


@pytest.mark.parametrize(
    "model_type",
    [
        "llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3", "qwen2_moe", "qwen3_moe",
        "ministral", "phi3", "smollm3", "olmo2", "granite",
    ],
)
def test_missing_keys_take_transformers_defaults(model_type: str) -> None:
    assert config_from_hf({"model_type": model_type}) == config_from_hf(
        AutoConfig.for_model(model_type).to_dict()
    )


def test_transformers4_style_keys() -> None:
    llama31 = config_from_hf(
        {
            "model_type": "llama",
            "num_hidden_layers": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128008, 128009],
        }
    )
    assert llama31.rope_theta == 500000.0 and llama31.eos_token_ids == (128001, 128008, 128009)
    assert llama31.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config_from_hf(
        {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 4}}
    ).rope_scaling == (RopeScaling("linear", 4.0))
    gemma = config_from_hf(
        {
            "model_type": "gemma3",
            "eos_token_id": [1, 106],
            "text_config": {
                "model_type": "gemma3_text",
                "num_hidden_layers": 8,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                "rope_local_base_freq": 20000.0,
                "sliding_window": 1024,
                "sliding_window_pattern": 4,
            },
        }
    )
    assert gemma.architecture == "gemma3" and gemma.eos_token_ids == (1, 106)
    assert (gemma.rope_theta, gemma.rope_local_theta, gemma.rope_scaling) == (
        1e6,
        20000.0,
        RopeScaling("linear", 8.0),
    )
    assert gemma.layer_types == (("sliding_attention",) * 3 + ("full_attention",)) * 2
    qwen25 = config_from_hf(
        {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21}
    )
    assert (
        qwen25.sliding_window is None
        and set(qwen25.layer_types) == {"full_attention"}
        and qwen25.attention_bias
    )
    qwen2_windowed = config_from_hf(
        {"model_type": "qwen2", "num_hidden_layers": 4, "use_sliding_window": True, "max_window_layers": 3}
    )
    assert qwen2_windowed.layer_types == ("full_attention",) * 3 + ("sliding_attention",)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"vocab_size": 10}, "unsupported model_type None"),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "unsupported RoPE type 'yarn'",
        ),
        (
            {"model_type": "llama", "rope_scaling": {"rope_type": "linear"}},
            "linear RoPE parameters lack 'factor'",
        ),
        ({"model_type": "llama", "rope_parameters": {"partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias=True"),
        ({"model_type": "olmo2", "attention_bias": True}, "attention_bias=True"),
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48}},
            "longrope RoPE parameters lack 'long_factor'",
        ),
        ({"model_type": "gemma3_text", "final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
        (
            {
                "model_type": "gemma3_text",
                "rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2}},
            },
            "sliding-window layers",
        ),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "num_hidden_layers": 2,
                "layer_types": ["full_attention"],
            },
            "inconsistent qwen2",
        ),
        (
            {"model_type": "gemma3_text", "num_hidden_layers": 1, "layer_types": ["chunked"]},
            "layer type 'chunked'",
        ),
    ],
)
def test_unsupported_configs_raise_typed_error(cfg: dict, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        config_from_hf(cfg)


def test_hf_config_dict_refuses_configs_no_transformers_family_expresses() -> None:
    for config in (
        dataclasses.replace(TINY_CONFIGS["qwen2"], qk_norm=True),  # q/k/v bias and q/k norms
        dataclasses.replace(TINY_CONFIGS["smollm3"], attention_multiplier=0.1),  # SmolLM3's NoPE and Granite's scale
        dataclasses.replace(TINY_CONFIGS["llama"], rotary_dim=8),  # partial rotary outside Phi-3
    ):
        with pytest.raises(InvalidArgumentError, match="no transformers model_type"):
            hf_config_dict(config)
