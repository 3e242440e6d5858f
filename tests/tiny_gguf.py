"""Tiny GGUF files written the way llama.cpp's converter (convert_hf_to_gguf.py) writes them, from the HF
tensors of the tiny random models of tests/tiny_models.py: llama q/k rows permuted for its RoPE layout,
Gemma norms stored as 1 + w, shapes innermost first, tensors under llama.cpp's names."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import gguf
import numpy as np
import torch

from kiln.models.config import ModelConfig
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

VOCAB = TINY_CONFIGS["llama"].vocab_size
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    # A mixture of experts: the router, the experts stacked per projection (see stack_experts), the shared
    # expert and its gate.
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GGUF_LAYER_NAMES_BY_ARCH = {
    "llama": {**_GGUF_LAYER_NAMES, "post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        **_GGUF_LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "olmo2": {
        **_GGUF_LAYER_NAMES,
        "post_attention_layernorm": "post_attention_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {
        **_GGUF_LAYER_NAMES,
        "post_attention_layernorm": "ffn_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    },
}
# llama.cpp's converter permutes q/k rows of these (LlamaModel subclasses with undo_permute).
ROPE_PERMUTED_ARCHS = ("llama", "smollm3", "granite")
_GGUF_GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def spm_metadata(gemma: bool) -> dict:
    """A 256-piece SentencePiece vocabulary in GGUF form (Gemma's or Llama's special tokens)."""
    specials = (
        ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        if gemma
        else ["<unk>", "<s>", "</s>"]
    )
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [
        "\u2581",
        *letters,
        *(f"\u2581{c}" for c in letters),
        *(a + b for a in letters for b in letters),
    ]
    tokens = specials + pieces[: VOCAB - len(specials)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0 if t in specials else -float(i) for i, t in enumerate(tokens)],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens],
        "tokenizer.ggml.bos_token_id": tokens.index("<bos>" if gemma else "<s>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<eos>" if gemma else "</s>"),
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
        "tokenizer.ggml.add_space_prefix": not gemma,
    }


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str, arch: str) -> str:
    stem, kind = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, index, rest = stem.split(".", 3)
        layer_names = _GGUF_LAYER_NAMES_BY_ARCH.get(arch, _GGUF_LAYER_NAMES_BY_ARCH["llama"])
        return f"blk.{index}.{layer_names[rest]}.{kind}"
    return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"


def llama_cpp_tensor(name: str, tensor: torch.Tensor, arch: str, config: ModelConfig) -> np.ndarray:
    """A tensor as llama.cpp's converter stores it."""
    data = tensor.detach().numpy().astype(np.float32)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return data + np.float32(1.0)
    if arch in ROPE_PERMUTED_ARCHS and ".q_proj." in name:
        return llama_cpp_permute(data, config.num_heads)
    if arch in ROPE_PERMUTED_ARCHS and ".k_proj." in name:
        return llama_cpp_permute(data, config.num_kv_heads)
    return data


def write_gguf(
    path: Path,
    arch: str,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    quantize: bool | str = False,
    keep_float: Collection[str] = (),
    rope_freqs: np.ndarray | None = None,
    original_context: int | None = None,
    metadata: dict[str, object] | None = None,
    name: str | None = None,
) -> None:
    """A GGUF of `tensors` (HF names) with `config`'s metadata and `metadata`'s keys. quantize: matrices
    as Q8_0 (True) or as the GGML type it names (one gguf-py quantises: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), but
    for those named in `keep_float`."""
    qtype = gguf.GGMLQuantizationType[quantize if isinstance(quantize, str) else "Q8_0"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name or f"tiny {arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_rope_dimension_count(config.rotary_dim or config.head_dim)
    if arch == "phi3":  # its converter writes the window (0: none), which llama.cpp then ignores
        writer.add_sliding_window(config.sliding_window or 0)
    if config.rope_scaling is not None and config.rope_scaling.kind == "longrope":
        # Phi-3's converter: the factors as tensors, the attention factor (transformers' default formula,
        # which the tiny configs give explicitly) and the original context as keys.
        writer.add_rope_scaling_attn_factors(config.rope_scaling.attention_factor)
        writer.add_rope_scaling_orig_ctx_len(config.rope_scaling.original_max_position_embeddings)
        writer.add_tensor("rope_factors_long.weight", np.array(config.rope_scaling.long_factor, np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(config.rope_scaling.short_factor, np.float32))
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier or config.head_dim**-0.5)
        writer.add_logit_scale(config.logits_scaling)
    if config.sliding_window and arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.experts_per_token)
        writer.add_expert_feed_forward_length(config.moe.expert_intermediate_size)
        if config.moe.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(config.moe.shared_expert_intermediate_size)
    if config.rope_scaling is not None and config.rope_scaling.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(config.rope_scaling.factor)
    if original_context is not None:
        writer.add_rope_scaling_orig_ctx_len(original_context)
    for key, value in (spm_metadata(gemma=arch == "gemma3") | (metadata or {})).items():
        writer.add_key_value(key, value, _value_type(value))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, tensor in stack_experts(tensors).items():
        data = llama_cpp_tensor(name, tensor, arch, config)
        if quantize and data.ndim >= 2 and ".mlp.gate." not in name and name not in keep_float:  # routers stay F32
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name, arch), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with each layer's experts (model.layers.0.mlp.experts.3.gate_proj.weight) stacked in
    expert order into one [experts, rows, cols] tensor per projection (model.layers.0.mlp.experts.gate_proj
    .weight), as llama.cpp's converter stacks them."""
    stacked: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        layer, found, rest = name.partition(".mlp.experts.")
        if not found:
            stacked[name] = tensor
            continue
        index, projection = rest.split(".", 1)
        experts.setdefault(f"{layer}.mlp.experts.{projection}", {})[int(index)] = tensor
    for name, by_index in experts.items():
        stacked[name] = torch.stack([by_index[index] for index in range(len(by_index))])
    return stacked


def _value_type(value: object) -> gguf.GGUFValueType:
    if isinstance(value, list):
        return gguf.GGUFValueType.ARRAY
    return {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, str: gguf.GGUFValueType.STRING}[
        type(value)
    ]




# The tiny models whose GGUF files are compared with llama.cpp (tests/models/test_gguf_architectures.py),
# by the llama.cpp architecture their converter writes: Mistral and Ministral files are "llama".
REFERENCE_ARCHITECTURES = {
    "mistral": "llama",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
}
# BOS, then ids past Gemma's 8-token window and SmolLM3's NoPE layer's reach.
REFERENCE_TOKENS = [1, 37, 112, 5, 200, 64, 9, 150, 33, 255, 71, 18]


def write_reference_gguf(name: str, path: Path) -> Path:
    """The float32 GGUF of tiny model `name` (seed 0) that llama.cpp's logits were recorded on."""
    # Not named after its architecture: llama.cpp's vocabulary special-cases names containing "phi3".
    tensors = hf_state_dict(tiny_hf_model(name))
    write_gguf(path, REFERENCE_ARCHITECTURES[name], TINY_CONFIGS[name], tensors, name="kiln tiny reference")
    return path


if __name__ == "__main__":  # python -m tests.tiny_gguf DIR: the reference files, for the recording script
    import sys

    for reference in REFERENCE_ARCHITECTURES:
        write_reference_gguf(reference, Path(sys.argv[1]) / f"{reference}.gguf")
