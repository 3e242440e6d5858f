"""A plain PyTorch decoder replayed as CUDA graphs: the decode speed a GPU reaches with stock ops, a static KV
cache and one graph per batch size, no custom kernels and no torch.compile (gpt-fast's shape of model). bench/gpu.py
runs it beside Kiln as the floor a GPU runtime's decode step should reach.

Llama (RMSNorm, RoPE, SwiGLU, GQA) and Gemma 3 (GELU-tanh, q/k norms, (1 + w) norms before and after attention and
MLP, embeddings scaled by sqrt(hidden), sliding-window layers with their own RoPE base) in one file. Like gpt-fast
and vLLM, q/k/v and gate/up are each one matmul; a Gemma norm's 1 + w is added once at load. Attention is
F.scaled_dot_product_attention over the whole static cache under a position mask, so a decode step is the same
work at every position and the graph captures it once. `graph=False` runs the same step eagerly (the CPU check of
its math against transformers, bench/gpu.py --device cpu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """What the decoder needs of a model; `sliding_window` applies to the layers `local_layers` names."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rope_theta: float
    eps: float
    gemma: bool = False
    sliding_window: int | None = None
    local_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5


def _rope_table(theta: float, head_dim: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq).repeat(1, 2)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Decoder:
    """Weights (HF tensor names in, fused and cast once) and the forward over a static KV cache."""

    def __init__(self, shape: Shape, tensors: dict[str, torch.Tensor], device: str, dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, torch.device(device), dtype
        one = 1.0 if shape.gemma else 0.0

        def get(name: str, plus: float = 0.0) -> torch.Tensor:
            return (tensors[name].to(self.device, torch.float32) + plus).to(dtype)

        self.embed = get("model.embed_tokens.weight")
        self.head = get("lm_head.weight") if "lm_head.weight" in tensors else self.embed
        self.norm = get("model.norm.weight", one)
        self.embed_scale = torch.tensor(shape.hidden**0.5, dtype=dtype, device=self.device)  # Gemma's, as HF rounds it
        self.layers = []
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            layer = {"qkv": torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                     "o": get(p + "self_attn.o_proj.weight"),
                     "gate_up": torch.cat([get(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]),
                     "down": get(p + "mlp.down_proj.weight"),
                     "in_norm": get(p + "input_layernorm.weight", one),
                     "attn_norm": get(p + "post_attention_layernorm.weight", one)}
            if shape.gemma:
                layer |= {name: get(p + key, one) for name, key in (
                    ("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight"),
                    ("ff_norm", "pre_feedforward_layernorm.weight"), ("post_ff_norm", "post_feedforward_layernorm.weight"))}
            self.layers.append(layer)

    def weight_bytes(self) -> int:
        """Bytes one decode step reads: every projection and the LM head (embedding lookups excluded)."""
        mats = [m for layer in self.layers for k, m in layer.items() if m.ndim == 2]
        return sum(m.nbytes for m in [*mats, self.head])

    def forward(self, cache: Cache, tokens: torch.Tensor, pos: torch.Tensor, keys: int) -> torch.Tensor:
        """[B, T] token ids at positions `pos` [T] -> next-token logits [B, vocab] of the last row. K/V are written
        at `pos`; queries attend to cache positions [0, keys) under the causal (and sliding-window) mask."""
        s, (b, t) = self.shape, tokens.shape
        rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, s.eps)  # noqa: E731
        x = F.embedding(tokens, self.embed)
        if s.gemma:
            x = x * self.embed_scale
        key_pos = torch.arange(keys, device=self.device)
        causal = key_pos[None, :] <= pos[:, None]  # [T, keys]
        local = causal & (key_pos[None, :] > pos[:, None] - (s.sliding_window or keys))
        q_rows, kv_rows, group = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.heads // s.kv_heads
        for i, (w, k_cache, v_cache) in enumerate(zip(self.layers, cache.k, cache.v, strict=True)):
            is_local = i in s.local_layers
            cos, sin = (cache.local_rope if is_local else cache.rope)
            cos, sin = cos[pos], sin[pos]
            q, k, v = (rms(x, w["in_norm"]) @ w["qkv"].T).split((q_rows, kv_rows, kv_rows), dim=-1)
            q, k, v = (y.view(b, t, -1, s.head_dim).transpose(1, 2) for y in (q, k, v))
            if s.gemma:
                q, k = rms(q, w["q_norm"]), rms(k, w["k_norm"])
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            # GQA as a batch of kv_heads attentions whose rows are each one's query heads: no K/V copies, and
            # SDPA's memory-efficient kernel takes the mask (with enable_gqa it falls back to the math path).
            mask = (local if is_local else causal).repeat(group, 1)
            attn = F.scaled_dot_product_attention(q.reshape(b, s.kv_heads, group * t, s.head_dim), k_cache[:, :, :keys],
                                                  v_cache[:, :, :keys], attn_mask=mask, scale=s.attn_scale)
            attn = attn.view(b, s.heads, t, s.head_dim).transpose(1, 2).reshape(b, t, q_rows) @ w["o"].T
            x = x + rms(attn, w["attn_norm"]) if s.gemma else x + attn
            gate, up = (rms(x, w["ff_norm" if s.gemma else "attn_norm"]) @ w["gate_up"].T).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if s.gemma else F.silu(gate)
            mlp = (act * up) @ w["down"].T
            x = x + rms(mlp, w["post_ff_norm"]) if s.gemma else x + mlp
        return rms(x[:, -1], self.norm) @ self.head.T


class Cache:
    """A static KV cache for `batch` sequences of up to `length` positions, with the step's static inputs and,
    with `graph`, the decode step captured as a CUDA graph (once, at construction)."""

    def __init__(self, decoder: Decoder, batch: int, length: int, graph: bool) -> None:
        s, dev, self.decoder, self.length = decoder.shape, decoder.device, decoder, length
        size = (batch, s.kv_heads, length, s.head_dim)
        self.k = [torch.zeros(size, device=dev, dtype=decoder.dtype) for _ in range(s.layers)]
        self.v = [torch.zeros(size, device=dev, dtype=decoder.dtype) for _ in range(s.layers)]
        self.rope = _rope_table(s.rope_theta, s.head_dim, length, dev)
        self.local_rope = _rope_table(s.local_rope_theta or s.rope_theta, s.head_dim, length, dev)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=dev)  # the step's input, then its output
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph = None
        if graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up outside the graph: allocator pools, library handles
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()

    @torch.inference_mode()
    def _step(self) -> None:
        logits = self.decoder.forward(self, self.tokens, self.pos, self.length)
        self.tokens.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.add_(1)

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy: prefill [B, T] eagerly (attending to T keys), then `new_tokens` - 1 decode steps (replays);
        returns the new tokens [B, new_tokens]. Synchronous."""
        t = prompts.shape[1]
        if t + new_tokens > self.length or prompts.shape[0] != self.tokens.shape[0]:
            raise ValueError(f"cache of {tuple(self.tokens.shape)} x {self.length} positions, prompts {tuple(prompts.shape)}")
        out = torch.empty(prompts.shape[0], new_tokens, dtype=torch.long, device=self.decoder.device)
        logits = self.decoder.forward(self, prompts, torch.arange(t, device=self.decoder.device), t)
        self.tokens.copy_(logits.argmax(dim=-1, keepdim=True))
        self.pos.fill_(t)
        out[:, :1] = self.tokens
        for i in range(1, new_tokens):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            out[:, i : i + 1] = self.tokens
        if self.decoder.device.type == "cuda":
            torch.cuda.synchronize()
        return out

