"""Kiln's model definitions agree with transformers (fp32, eager attention) within 1e-4 on every logit:
one-shot, chunked and token-by-token runs through a real paged cache (small shuffled pages, released
out-of-window pages), mixed prefill/decode batches, plus the config.json mapping both ways."""

from __future__ import annotations

import copy
import dataclasses
import re
from itertools import zip_longest

import pytest
import torch
from transformers import AutoConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from kiln.engine.batch import SeqSlice, build_step
from kiln.errors import InvalidArgumentError
from kiln.kv.layout import KVLayout
from kiln.models import build_model
from kiln.models.causal_lm import CausalLM
from kiln.models.config import ModelConfig, RopeScaling
from kiln.models.hf_config import config_from_hf, hf_config_dict
from kiln.models.layers import RotaryEmbedding
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

ATOL = 1e-4


@dataclasses.dataclass
class Pair:
    """A tiny transformers model and Kiln's model loaded from its state dict."""

    config: ModelConfig
    hf: PreTrainedModel
    ours: CausalLM

    def reference(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] logits of one full causal forward in transformers."""
        with torch.no_grad():
            return self.hf(input_ids=torch.tensor([tokens])).logits[0]


def make_pair(name: str) -> Pair:
    config = TINY_CONFIGS[name]
    hf = tiny_hf_model(name)
    ours = build_model(config)
    ours.load_weights(hf_state_dict(hf))
    return Pair(config, hf, ours)


@pytest.fixture(scope="module", params=list(TINY_CONFIGS))
def pair(request: pytest.FixtureRequest) -> Pair:
    return make_pair(request.param)


WINDOWED_OR_SCALED = [name for name, c in TINY_CONFIGS.items() if c.sliding_window or c.rope_scaling]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PagedKV:
    """Test-side page bookkeeping over a pool bigger than needed. Pages are handed out in shuffled order
    holding finite garbage (as a reused page would). Pages never handed out are NaN, and so are pages a
    sliding-window group releases (`release=True`, the slices then start at first_pages > 0): reading
    either, even under a mask, would turn logits into NaN."""

    def __init__(
        self, config: ModelConfig, page_size: int, num_pages: int, release: bool, seed: int = 0
    ) -> None:
        self.layout = KVLayout.for_model(config, page_size)
        self.release = release
        self.generator = torch.Generator().manual_seed(seed)
        shape = (self.layout.slots, num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.k, self.v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        self.free = torch.randperm(num_pages, generator=self.generator).tolist()
        self.tables: dict[int, list[list[int]]] = {}
        self.released: set[int] = set()

    def slice(self, seq: int, start: int, tokens: list[int]) -> SeqSlice:
        tables = self.tables.setdefault(seq, [[] for _ in self.layout.groups])
        firsts = [self._first_needed(group.window, start) for group in self.layout.groups]
        for table, first in zip(tables, firsts, strict=True):
            while len(table) * self.layout.page_size < start + len(tokens):
                table.append(self._take())
            for page in set(table[:first]) - self.released:
                self.k[:, page] = self.v[:, page] = float("nan")
                self.released.add(page)
        return SeqSlice(start, tokens, [t[first:] for t, first in zip(tables, firsts, strict=True)], firsts)

    def _first_needed(self, window: int | None, start: int) -> int:
        """Index of the first page a query at `start` (or later) may read: keys > start - window."""
        if not self.release or window is None:
            return 0
        return max(0, start - window + 1) // self.layout.page_size

    def _take(self) -> int:
        page = self.free.pop()
        self.k[:, page] = torch.randn(self.k[:, page].shape, generator=self.generator)
        self.v[:, page] = torch.randn(self.v[:, page].shape, generator=self.generator)
        return page


def run(model: CausalLM, kv: PagedKV, tokens: dict[int, list[int]], steps: list[dict[int, int]]) -> dict:
    """Feed each step's {sequence: new token count} through build_step and the model; return each
    sequence's logits for all the positions it was fed, [positions, vocab]."""
    done = dict.fromkeys(tokens, 0)
    parts: dict[int, list[torch.Tensor]] = {seq: [] for seq in tokens}
    for step in steps:
        slices = [kv.slice(seq, done[seq], tokens[seq][done[seq] : done[seq] + n]) for seq, n in step.items()]
        inputs = build_step(slices, kv.layout, kv.k, kv.v)
        with torch.no_grad():
            logits = model.logits(model(inputs.input_ids, inputs.positions, inputs.attention))
        for (seq, n), part in zip(step.items(), logits.split(list(step.values())), strict=True):
            parts[seq].append(part)
            done[seq] += n
    return {seq: torch.cat(chunks) for seq, chunks in parts.items()}


def solo(pair: Pair, tokens: list[int], chunks: list[int], page_size: int, release: bool) -> torch.Tensor:
    pages = 2 * len(KVLayout.for_model(pair.config, page_size).groups) * (len(tokens) // page_size + 1)
    kv = PagedKV(pair.config, page_size, pages, release)
    return run(pair.ours, kv, {0: tokens}, [{0: n} for n in chunks])[0]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def test_one_shot_prefill(pair: Pair) -> None:
    tokens = random_tokens(40, seed=1)
    assert max_diff(solo(pair, tokens, [40], page_size=16, release=False), pair.reference(tokens)) <= ATOL


def test_chunked_prefill_irregular_chunks(pair: Pair) -> None:
    tokens = random_tokens(40, seed=2)
    ours = solo(pair, tokens, [5, 16, 3, 9, 1, 6], page_size=4, release=True)
    assert max_diff(ours, pair.reference(tokens)) <= ATOL


def test_token_by_token_decode_across_pages_and_windows(pair: Pair) -> None:
    tokens = random_tokens(100, seed=3)
    layout = KVLayout.for_model(pair.config, 4)
    kv = PagedKV(pair.config, 4, num_pages=2 * layout.num_groups * 26, release=True)
    ours = run(pair.ours, kv, {0: tokens}, [{0: 6}] + [{0: 1}] * 94)[0]
    assert max_diff(ours, pair.reference(tokens)) <= ATOL
    windows = [g.window for g in layout.groups if g.window is not None]
    # Every page wholly older than the window was released (poisoned) before the run ended.
    assert len(kv.released) == sum((100 - 1 - w + 1) // 4 for w in windows)


def test_mixed_prefill_and_decode_rows_in_one_step(pair: Pair) -> None:
    tokens = {0: random_tokens(45, seed=4), 1: random_tokens(23, seed=5), 2: random_tokens(30, seed=6)}
    plans = {0: [17, 11] + [1] * 17, 1: [5, 1, 1, 9] + [1] * 7, 2: [0, 9, 13] + [1] * 8}
    steps = [
        {seq: n for seq, n in zip(plans, counts, strict=True) if n}
        for counts in zip_longest(*plans.values(), fillvalue=0)
    ]
    assert any(len(step) == 3 and max(step.values()) > 1 for step in steps)  # prefill and decode rows mix
    layout = KVLayout.for_model(pair.config, 4)
    outputs = run(pair.ours, PagedKV(pair.config, 4, 2 * layout.num_groups * 40, release=True), tokens, steps)
    for seq, seq_tokens in tokens.items():
        assert max_diff(outputs[seq], pair.reference(seq_tokens)) <= ATOL, f"sequence {seq}"


@pytest.mark.parametrize("name", WINDOWED_OR_SCALED)
def test_window_and_rope_scaling_are_exercised(name: str) -> None:
    """The parity tests above can fail: the same weights with a window one wider, or without the RoPE
    scaling, disagree with transformers far beyond the tolerance."""
    pair = make_pair(name)
    variants = []
    if pair.config.sliding_window:
        variants.append(dataclasses.replace(pair.config, sliding_window=pair.config.sliding_window + 1))
    if pair.config.rope_scaling:
        variants.append(dataclasses.replace(pair.config, rope_scaling=None))
    tokens = random_tokens(40, seed=7)
    for config in variants:
        model = build_model(config)
        model.load_weights(hf_state_dict(pair.hf))
        kv = PagedKV(config, 4, 2 * KVLayout.for_model(config, 4).num_groups * 11, release=False)
        ours = run(model, kv, {0: tokens}, [{0: 40}])[0]
        assert max_diff(ours, pair.reference(tokens)) > 1e-2


def test_bfloat16_model_tracks_transformers_in_bfloat16(pair: Pair) -> None:
    """bf16 rounds differently in SDPA and eager attention, so only closeness is asserted; this guards the
    dtype plumbing (norms in fp32, rotary tables and Gemma's embedding scale cast like transformers)."""
    hf = copy.deepcopy(pair.hf).to(torch.bfloat16)
    model = build_model(pair.config, dtype=torch.bfloat16)
    model.load_weights(hf_state_dict(hf))
    tokens = random_tokens(40, seed=8)
    layout = KVLayout.for_model(pair.config, 4)
    kv = PagedKV(pair.config, 4, 2 * layout.num_groups * 11, release=True)
    kv.k, kv.v = kv.k.to(torch.bfloat16), kv.v.to(torch.bfloat16)
    ours = run(model, kv, {0: tokens}, [{0: 13}, {0: 27}])[0]
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([tokens])).logits[0].float()
    assert ours.dtype == torch.float32
    assert max_diff(ours, reference) <= 0.02 * reference.abs().max().item()


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
    rotary(torch.tensor([0, 7]), torch.float32)
    positions = torch.tensor([3, 4095, 4096, 9000, 70000])
    cos, sin = rotary(positions, torch.float32)
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


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3"])
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
    mixed = dataclasses.replace(TINY_CONFIGS["qwen2"], attention_bias=False)
    with pytest.raises(InvalidArgumentError):
        hf_config_dict(mixed)
