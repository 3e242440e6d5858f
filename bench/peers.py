"""The two peers, built the way their users would, on the same model as Kiln.

- HF transformers: `Gemma3ForCausalLM` (via the Auto classes) holding exactly the fp32 tensors Kiln
  runs, so any gap between the two is the runtime, not the weights. Greedy `generate`, no stop token.
- llama.cpp through llama-cpp-python: the GGUF file Kiln's weights were dequantised from, run with
  its own quantised (Q4_K_M) kernels, f16 KV cache, two threads.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch
from common import THREADS

# llama.cpp sizes its context in multiples of this many cells.
_LLAMA_CTX_ALIGN = 256
# llama.cpp's own default logical and physical batch sizes (llama-cli, llama-server).
LLAMA_N_BATCH = 2048
LLAMA_N_UBATCH = 512
# Bytes per element of the llama.cpp KV cache types we may meet (GGML_TYPE_F32, GGML_TYPE_F16).
_GGML_TYPE_BYTES = {0: 4, 1: 2}


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


def open_llama(path: str, n_ctx: int) -> Any:
    """A llama_cpp.Llama on `path` with room for `n_ctx` tokens and two threads for both prompt and
    generation (its default would be one thread for generation on this machine)."""
    from llama_cpp import Llama

    return Llama(
        model_path=path,
        n_ctx=_align(n_ctx),
        n_batch=LLAMA_N_BATCH,
        n_ubatch=LLAMA_N_UBATCH,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )


def llama_kv_bytes_per_token(llama: Any, config: Any) -> int:
    """K and V of every layer (`config`: the kiln ModelConfig of the same model) at the context's
    cache types (f16 by default)."""
    params = llama.context_params
    per_layer = config.num_kv_heads * config.head_dim * (_GGML_TYPE_BYTES[params.type_k] + _GGML_TYPE_BYTES[params.type_v])
    return config.num_layers * per_layer


def _align(n: int) -> int:
    return -(-n // _LLAMA_CTX_ALIGN) * _LLAMA_CTX_ALIGN


class LlamaBatchDecoder:
    """llama.cpp's own batched decoding through its C API, as its examples/batched does: one context
    with a KV sequence per prompt, and each step decodes the next token of every sequence in a single
    llama_decode call. llama-cpp-python's high-level API decodes one sequence at a time, so this is the
    only honest way to measure llama.cpp at batch > 1. Greedy: argmax of each sequence's logits."""

    def __init__(self, llama: Any, max_seqs: int, seq_len: int) -> None:
        import llama_cpp

        self._api = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = max_seqs
        params.n_ctx = max_seqs * _align(seq_len)  # each sequence gets n_ctx / n_seq_max cells
        params.n_batch = LLAMA_N_BATCH
        params.n_ubatch = LLAMA_N_UBATCH
        params.n_threads = params.n_threads_batch = THREADS
        self._ctx = llama_cpp.llama_init_from_model(llama.model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create the batched-decoding context")
        self._batch = llama_cpp.llama_batch_init(LLAMA_N_BATCH, 0, 1)
        self._n_vocab = llama.n_vocab()
        self.max_seqs = max_seqs

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt by `max_tokens` tokens, all sequences in one batch."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)
        outputs = [[self._prefill(seq, prompt)] for seq, prompt in enumerate(prompts)]
        for step in range(1, max_tokens):
            entries = [(out[-1], len(prompt) + step - 1, seq, True) for seq, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))]
            self._decode(entries)
            for row, out in enumerate(outputs):
                out.append(self._argmax(row))
        return outputs

    def start_sessions(self) -> None:
        """Forget every sequence; `turn` then grows one per agent."""
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)
        self._lengths = [0] * self.max_seqs
        self._pending: list[list[int]] = [[] for _ in range(self.max_seqs)]

    def turn(self, new_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        """One agent turn for sequences 0..len(new_ids)-1 in lockstep: every sequence's new ids (and the
        last token it generated, not yet computed) in shared llama_decode batches, then `max_tokens`
        greedy tokens of all of them, one llama_decode per step."""
        entries: list[tuple[int, int, int, bool]] = []
        last_row: dict[int, int] = {}
        for seq, ids in enumerate(new_ids):
            ids = [*self._pending[seq], *ids]
            entries += [(token, self._lengths[seq] + i, seq, i == len(ids) - 1) for i, token in enumerate(ids)]
            self._lengths[seq] += len(ids)
        outputs: list[list[int]] = [[] for _ in new_ids]
        for start in range(0, len(entries), LLAMA_N_BATCH):
            part = entries[start : start + LLAMA_N_BATCH]
            self._decode(part)
            last_row.update({seq: row for row, (_, _, seq, wants) in enumerate(part) if wants})
            for seq, row in list(last_row.items()):
                if not outputs[seq]:
                    outputs[seq].append(self._argmax(row))
            last_row.clear()
        for _ in range(1, max_tokens):
            self._decode([(out[-1], self._lengths[seq], seq, True) for seq, out in enumerate(outputs)])
            for seq, out in enumerate(outputs):
                self._lengths[seq] += 1
                out.append(self._argmax(seq))
        self._pending = [[out[-1]] for out in outputs] + self._pending[len(outputs) :]
        return outputs

    def _prefill(self, seq: int, prompt: list[int]) -> int:
        """Compute one prompt into sequence `seq`; returns its first generated token."""
        for start in range(0, len(prompt), LLAMA_N_BATCH):
            chunk = prompt[start : start + LLAMA_N_BATCH]
            last = start + len(chunk) == len(prompt)
            self._decode([(token, start + i, seq, last and i == len(chunk) - 1) for i, token in enumerate(chunk)])
        return self._argmax(-1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants logits) entries."""
        batch = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        code = self._api.llama_decode(self._ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, row: int) -> int:
        pointer = self._api.llama_get_logits_ith(self._ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,))
        return int(logits.argmax())

    def close(self) -> None:
        self._api.llama_batch_free(self._batch)
        self._api.llama_free(self._ctx)
