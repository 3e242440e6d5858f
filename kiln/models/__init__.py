"""Model definitions Kiln owns. `build_model` picks the file by `ModelConfig.architecture`."""

from __future__ import annotations

import torch

from kiln.errors import InvalidArgumentError
from kiln.models.causal_lm import CausalLM
from kiln.models.config import ModelConfig
from kiln.models.gemma3 import Gemma3
from kiln.models.llama import Llama
from kiln.models.olmo2 import Olmo2
from kiln.models.quant import quantize_model

__all__ = ["ARCHITECTURES", "build_model", "quantize_model"]

ARCHITECTURES: dict[str, type[CausalLM]] = {"llama": Llama, "gemma3": Gemma3, "olmo2": Olmo2}


def build_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> CausalLM:
    """An inference-mode model with uninitialised weights on `device`: call load_weights next. Built on
    the meta device first, so no time goes into random initialisation of weights about to be replaced."""
    if config.architecture not in ARCHITECTURES:
        raise InvalidArgumentError(f"unsupported architecture {config.architecture!r}")
    with torch.device("meta"):
        model = ARCHITECTURES[config.architecture](config)
    return model.to(dtype=dtype).to_empty(device=device).eval().requires_grad_(False)
