"""The two peers, built the way their users would, on the same model as Kiln.

- HF transformers: `Gemma3ForCausalLM` (via the Auto classes) holding exactly the fp32 tensors Kiln
  runs, so any gap between the two is the runtime, not the weights. Greedy `generate`, no stop token.
- llama.cpp through llama-cpp-python: the GGUF file Kiln's weights were dequantised from, run with
  its own quantised (Q4_K_M) kernels, f16 KV cache, two threads, in a process of its own
  (bench/llama_cpp_worker.py) without Kiln's OpenMP wait policy.
"""

from __future__ import annotations

from typing import Any

import common
import torch


def build_hf_model(loaded: Any) -> torch.nn.Module:
    """The transformers model for `loaded` (a kiln LoadedModel), with its weights; raises if the tensor
    names do not cover the model exactly, so the peer cannot silently run random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.models.hf_config import hf_config_dict

    settings = hf_config_dict(loaded.config)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = set(result.missing_keys) - tied
    if missing or result.unexpected_keys:
        raise RuntimeError(f"HF model/tensor mismatch: missing {sorted(missing)[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    # Generate exactly the requested number of tokens, as Kiln does with ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    return model.eval()


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int, cache: Any = None) -> tuple[torch.Tensor, Any]:
    """Greedy `generate` over equal-length prompts; returns (new tokens [batch, n], the KV cache).
    With `cache` None it computes the whole prompt, which is what HF users get by default."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor(prompts, device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            past_key_values=cache,
        )
    return out.sequences[:, len(prompts[0]) :], out.past_key_values


def hf_kv_bytes_per_token(model: torch.nn.Module) -> int:
    """K and V of every layer in the model's dtype: what its DynamicCache stores per token before the
    sliding-window layers drop old positions."""
    config = model.config
    element = next(model.parameters()).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of all tensor data in a GGUF file (what llama.cpp reads per decoded token when the output
    head is tied to the token embeddings, as Gemma's is)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def missing_reason(system: str, peer_python: str | None) -> str | None:
    """common.missing_reason, except that llama.cpp runs under `peer_python` when one is given (a venv of
    its own), so this Python need not have it."""
    return None if system == "llamacpp" and peer_python else common.missing_reason(system)
