"""EngineConfig: every knob of a Kiln engine in one place; CLI flags mirror these fields."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kiln.errors import InvalidArgumentError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# How the projections and the LM head are stored (kiln/models/packed.py): fp32, or fbgemm fp16 / int8.
WEIGHT_FORMATS = ("float32", "fp16", "int8")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF-style directory or .gguf file; None = the embedded Gemma 3 270M
    device: str = "cpu"
    dtype: str = "float32"  # weights and activations
    # Projections and LM head packed for CPU decode, which is bound by reading weights: "fp16" halves the
    # bytes per token (same greedy tokens), "int8" quarters them (embedded model perplexity +27 %).
    # Needs dtype float32 and device cpu (kiln/models/packed.py).
    weight_format: str = "float32"
    kv_dtype: str | None = None  # KV pages; None = same as dtype
    page_size: int = 16  # tokens per KV page
    kv_budget_bytes: int = 2 * 1024**3  # memory for KV pages; the pool is sized from it at start
    max_num_seqs: int = 32  # requests in one step
    max_batched_tokens: int = 1024  # tokens in one step (decode rows count 1)
    # Most tokens of one prompt a step computes. Longer prompts are prefilled in chunks, so steps stay
    # short and a request arriving meanwhile gets its first token within about two steps. A 4k prompt
    # alone took 3 % longer at 256 than at 1024 on the 2-core CPU; bench/prefill_fairness.py compares both.
    prefill_chunk_tokens: int = 256
    max_model_len: int | None = None  # longest history; None = the model's context length
    max_sessions: int = 4096  # live sessions; the least recently used idle one is evicted past this
    session_ttl_s: float = 3600.0  # idle sessions older than this are evicted
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    cache_dir: str | None = None  # converted-weight cache; None = $KILN_CACHE_DIR or ~/.cache/kiln

    def __post_init__(self) -> None:
        problems = []
        for name in ("page_size", "kv_budget_bytes", "max_num_seqs", "max_batched_tokens", "prefill_chunk_tokens", "max_sessions"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        for name in ("dtype", "kv_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                problems.append(f"{name} must be one of {sorted(DTYPES)}, got {value!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            problems.append(f"weight_format must be one of {list(WEIGHT_FORMATS)}, got {self.weight_format!r}")
        elif self.weight_format != "float32" and (self.dtype != "float32" or self.device.split(":")[0] != "cpu"):
            problems.append(
                f"weight_format {self.weight_format!r} needs dtype 'float32' and device 'cpu' (got {self.dtype!r} "
                f"on {self.device!r}): its fbgemm kernels run on the CPU only and take float32 activations"
            )
        if self.session_ttl_s <= 0:
            problems.append("session_ttl_s must be positive")
        if problems:
            raise InvalidArgumentError("invalid engine config: " + "; ".join(problems))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype or self.dtype]

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown engine options: {', '.join(unknown)}")
        return cls(**kwargs)  # type: ignore[arg-type]
