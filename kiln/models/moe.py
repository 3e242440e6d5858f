"""Sparse mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE), as transformers computes it.

A router scores every expert for each row (token) of a step, softmax over all experts, keeps the top
k (renormalised to sum to 1 with `norm_topk_prob`), and the row's output is the weighted sum of those k
SwiGLU experts; a shared expert, where the model has one, adds sigmoid(gate(x)) * shared(x). Rows of a
step are routed one by one, whatever sequence they belong to (prefill chunks and decode rows alike).

Why a loop over the experts a step hits: each expert is a `GatedMLP` of its own nn.Linear layers, so the
weight path of dense layers serves experts unchanged (loaded by their HF names, quantised to int8 by
`quantize_model`, run by the kernels), and a step computes each hit expert once over the rows routed to
it; decode of one token runs k experts, not all of them. The router and the shared expert's gate stay
float (`RoutingProjection`): an int8 rounding there would change which weights run, not just the values,
and llama.cpp keeps them float too.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.config import ModelConfig, MoEConfig
from kiln.models.layers import GatedMLP
from kiln.models.quant import QuantizedLinear
from kiln.platform import Platform


class RoutingProjection(nn.Module):
    """x @ W^T with W [out, in] kept in the model's dtype under every weight format (quantize_model swaps
    nn.Linear layers only). float32 on a CPU with Kiln's kernels, computed by their float32 linear kernel,
    whose result for a row does not depend on the other rows of the step (INV-3): a token's experts then
    do not either, in every mode (BLAS's sums may change order with the row count, and a near tie in the
    top-k with them). The kernel layer (a float32 QuantizedLinear, held unregistered: state_dict keeps the
    HF name alone) is made at the first forward, so weights are loaded first (as CausalLM.load_weights is
    called before any forward)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self._kernel: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is None and self._kernel_computes(x):
            self._kernel = QuantizedLinear.quantize(self.weight, None, "float32").forward
        return F.linear(x, self.weight) if self._kernel is None else self._kernel(x)

    def _kernel_computes(self, x: torch.Tensor) -> bool:
        weight = self.weight
        return (
            x.dtype == weight.dtype == torch.float32
            and x.device == weight.device
            and Platform.of(weight.device).kernels
            and weight.shape[1] % 8 == 0
        )


class SparseMoE(nn.Module):
    """The feed-forward of a sparse layer: x [N, hidden] -> [N, hidden]. Submodule names are the HF
    checkpoint's (`mlp.gate`, `mlp.experts.3.gate_proj`, `mlp.shared_expert`, `mlp.shared_expert_gate`)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, activation: str) -> None:
        super().__init__()
        self.top_k, self.normalize = moe.experts_per_token, moe.norm_topk_prob
        self.gate = RoutingProjection(hidden_size, moe.num_experts)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe.expert_intermediate_size, activation) for _ in range(moe.num_experts)
        )
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(hidden_size, shared, activation) if shared else None
        self.shared_expert_gate = RoutingProjection(hidden_size, 1) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [N, k] (long) and their weights [N, k] (float32), as transformers' TopKRouter."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        out = self._routed_one_row(x, experts, weights) if x.shape[0] == 1 else self._routed(x, experts, weights)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out += _sigmoid_by_row(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _routed(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows grouped by expert, in expert order: each hit expert runs once, and every row sums its
        experts' outputs in expert order, as transformers does (and whatever else the step holds)."""
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k
        row_weights = weights.flatten()[order].to(x.dtype)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(torch.bincount(flat, minlength=len(self.experts)).tolist()):
            if count:
                picked = rows[start : start + count]
                routed = self.experts[expert](x.index_select(0, picked))
                out.index_add_(0, picked, routed * row_weights[start : start + count])
                start += count
        return out

    def _routed_one_row(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`_routed` for a step of one row (a single sequence's decode) without its sort, count and gathers,
        a dozen ops fewer per layer: the same sums in the same order, so the same bits."""
        out = torch.zeros_like(x)
        for expert, weight in sorted(zip(experts[0].tolist(), weights[0].to(x.dtype).tolist(), strict=True)):
            out += self.experts[expert](x) * weight
        return out


def _sigmoid_by_row(z: torch.Tensor) -> torch.Tensor:
    """sigmoid of [N, 1], one value at a time in float64: torch's vectorised exp and its scalar tail differ
    in the last bit, so a value's sigmoid would depend on where its row falls in the step (INV-3)."""
    values = [[0.5 * (1.0 + math.tanh(0.5 * value))] for (value,) in z.tolist()]
    return torch.tensor(values, dtype=z.dtype, device=z.device)


def feed_forward(config: ModelConfig, layer: int) -> nn.Module:
    """Layer `layer`'s feed-forward: a SparseMoE where the config makes the layer sparse, else the dense
    GatedMLP of `intermediate_size`."""
    if config.moe is not None and config.moe.is_sparse(layer):
        return SparseMoE(config.hidden_size, config.moe, config.hidden_act)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


def sparse_layer_shapes(hidden: int, moe: MoEConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (below `model.layers.N.`) -> torch shape, for one sparse layer's feed-forward."""
    inner = moe.expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"mlp.gate.weight": (moe.num_experts, hidden)}
    for expert in range(moe.num_experts):
        shapes |= _mlp_shapes(f"mlp.experts.{expert}", hidden, inner)
    if moe.shared_expert_intermediate_size:
        shapes |= _mlp_shapes("mlp.shared_expert", hidden, moe.shared_expert_intermediate_size)
        shapes["mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (inner, hidden),
        f"{prefix}.up_proj.weight": (inner, hidden),
        f"{prefix}.down_proj.weight": (hidden, inner),
    }
