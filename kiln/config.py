"""EngineConfig: every knob of a Kiln engine in one place; CLI flags mirror these fields."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from kiln.errors import InvalidArgumentError
from kiln.kernels.page_format import PAGE_SIZES
from kiln.kv.codec import CODECS
from kiln.kv.policy import POLICIES
from kiln.platform import KERNEL_WEIGHT_FORMATS, Platform

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# How the projections and the LM head are stored and computed; "auto" picks per machine (kiln/platform.py).
QUANTIZATIONS = ("auto", *KERNEL_WEIGHT_FORMATS)
SPECULATIVE_METHODS = ("ngram",)  # kiln/engine/speculative.py
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # a name (kiln/models/catalog.py), HF-style directory or .gguf file; None = gemma3-270m
    device: str = "cpu"
    # Weights and activations. "auto": bfloat16 on a GPU (its tensor cores' format, half float32's bytes to read
    # per step), float32 on the CPU (what Kiln's kernels compute in).
    dtype: str = "auto"
    # How projections and the LM head are computed. CPU decode is bound by reading weights. "gguf": a GGUF
    # file's quantised blocks as the file stores them (kiln/models/gguf_blocks.py: no second rounding, no
    # converted copy), other layers (float tensors, 2- and 3-bit types) as int8; "int8": every layer re-quantised
    # to int8 (kiln/models/quant.py; a quarter of fp32's bytes). None is the exact path in `dtype`, the
    # reference of the parity tests. "auto": "gguf" where Kiln's CPU kernels run (kiln/kernels: an AVX2 CPU,
    # built and loaded) and dtype is float32, else None. Either format on the CPU without the kernels is
    # refused, naming why they are unavailable.
    quantization: str | None = "auto"
    # Bit-identical logits for a sequence whatever shares its batch, however its prefill is chunked, and
    # whether computed incrementally or at once: batch-invariant kernels for every matmul and attention.
    # CPU and float32 only; slower prefill (bench/throughput.py reports the cost).
    deterministic: bool = False
    # Speculative decoding from the sequence's own history (kiln/engine/speculative.py): "ngram" drafts
    # up to num_speculative_tokens tokens by prompt lookup and verifies them in one forward; greedy output
    # is unchanged and sampling keeps its distribution. None turns it off.
    # "auto": "ngram" on the CPU; off on a GPU, where a step carrying a draft runs eagerly, outside the decode
    # graphs and async scheduling, and costs more than the tokens it saves there.
    speculative: str | None = "auto"
    num_speculative_tokens: int = 4
    # KV pages' dtype. None: the same as dtype. "auto": float16 where the weights are quantised on the CPU (the
    # kernels read it in place at half float32's bytes, and decode attention is bound by reading them; llama.cpp
    # keeps float16 K/V too), else the same as dtype, so the exact path (quantization None) stays exact.
    kv_dtype: str | None = "auto"
    page_size: int = 16  # tokens per KV page: a power of two up to 256 (kiln/kernels/page_format.py, PAGE_SIZES)
    kv_budget_bytes: int = 2 * 1024**3  # memory for KV pages; the pool is sized from it at start
    max_num_seqs: int = 32  # requests in one step
    # Decode steps replayed as CUDA graphs (kiln/engine/decode_graphs.py): one graph per batch-size bucket, captured
    # at start-up, its inputs in static buffers. None: where the platform captures graphs (a GPU). True on the CPU
    # runs the same static, padded step without capture (what the tests check against the dynamic step).
    decode_graphs: bool | None = None
    # Launch the next decode step from this one's sampled ids while they are still on the device, and process
    # this step's tokens while it runs (kiln/engine/run_ahead.py: plain greedy decode steps over decode graphs).
    # None: where decode graphs are captured (a GPU, where the step's Python would otherwise idle the device).
    async_scheduling: bool | None = None
    # Most of those slots one caller (an API key; a connection on a server without keys) holds at once,
    # even alone. None: every free slot, given back down to a fair share when another caller waits
    # (kiln/engine/scheduler.py § Fair shares).
    max_seqs_per_caller: int | None = None
    # Tokens in one step (decode rows count 1). None: the platform's (Platform.step_tokens: 1,024 on the CPU, 8,192
    # on a GPU, whose prefill is bound by launches and reading weights until steps are thousands of tokens long).
    max_batched_tokens: int | None = None
    # Most tokens of one prompt a step computes. Longer prompts are prefilled in chunks, so steps stay
    # short and a request arriving meanwhile gets its first token within about two steps, at a small cost
    # to a long prompt alone (bench/prefill_fairness.py compares chunk sizes). None: the platform's (256 on the
    # CPU, 2,048 on a GPU).
    prefill_chunk_tokens: int | None = None
    # Which K/V of global-attention layers stays resident (kiln/kv/policy.py; overridable per session):
    # "full" keeps all (exact, grows with history); "sink_window" keeps the first kv_sink_tokens and the
    # last kv_window_tokens and drops the rest (bounded, approximate); "restore" keeps the same resident
    # set but moves the rest to the tiers below and streams it back during attention (bounded, exact).
    kv_policy: str = "full"
    kv_sink_tokens: int = 64
    kv_window_tokens: int = 2048
    # How KV pages are stored, in the pool, the tiers and snapshots (kiln/kv/codec.py): "none" (exact, the
    # KV dtype), "int8" (8-bit, a scale per token, head and 32 channels), "int4" (4-bit values, 8-bit keys).
    # Attention dequantises on read.
    kv_codec: str = "none"
    kv_host_budget_mb: int = 2048  # host-memory tier for evicted pages
    kv_disk_dir: str | None = None  # disk tier (one unlinked file in this directory); None = no disk tier
    kv_disk_budget_mb: int = 8192
    kv_stream_chunk_tokens: int = 1024  # keys per chunk of streamed attention: bounds a step's peak memory
    max_model_len: int | None = None  # longest history; None = the model's context length
    max_sessions: int = 4096  # live sessions; the least recently used idle one is evicted past this
    session_ttl_s: float = 3600.0  # idle sessions older than this are evicted
    # A session runs one generate at a time, in arrival order; a later one waits for those ahead of it
    # up to its caller's deadline or this many seconds, whichever is sooner, then FailedPreconditionError.
    generate_wait_s: float = 300.0
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    cache_dir: str | None = None  # converted-weight cache; None = $KILN_CACHE_DIR or ~/.cache/kiln
    # Persistence (kiln/snapshots): sessions are saved after each turn and on eviction and shutdown, and
    # come back by id after a restart; explicit snapshots and restores. A local directory, or a store URL
    # (redis://host:port/db, shared by several servers). Off when neither is set.
    snapshot_dir: str | None = None
    snapshot_store: str | None = None
    # The persistent prefix store (kiln/snapshots/prefix_store.py), on with persistence: full KV pages are
    # written behind to the snapshot store, at most this many MiB of them (least recently used dropped
    # first), and a prompt whose prefix the pool lacks fetches them instead of recomputing. 0: off.
    prefix_store_mb: int = 1024
    # A turn's finish is sent only once the turn is saved (kiln/snapshots/persistence.py's durability
    # rule): no acknowledged turn is lost to a crash, at the cost of a save's latency per turn.
    durable_turns: bool = False
    # This server's name among those sharing a snapshot store (kiln/snapshots/ownership.py): unique among
    # live ones; a restart under the same id takes over its sessions at once. None: random per LLM.
    instance_id: str | None = None
    # How long a session's lease outlives its owner's last renewal (kiln/snapshots/ownership.py): how long
    # the sessions of a server that died stay locked. None: LEASE_TTL_S; a fleet takes a shorter one.
    lease_ttl_s: float | None = None

    def __post_init__(self) -> None:
        problems = []
        cap = self.max_seqs_per_caller
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 0 < cap <= self.max_num_seqs):
            problems.append(f"max_seqs_per_caller must be an integer in [1, max_num_seqs = {self.max_num_seqs}] or None, "
                            f"got {cap!r}")
        if self.lease_ttl_s is not None and not 0 < self.lease_ttl_s < 3600:
            problems.append(f"lease_ttl_s must be between 0 and 3600 seconds, got {self.lease_ttl_s}")
        try:
            platform = Platform.of(self.device)
        except (RuntimeError, TypeError) as error:  # torch.device's refusal of a malformed name
            problems.append(f"device must name a torch device ('cpu', 'cuda:0'), got {self.device!r}: {error}")
            platform = Platform.of("cpu")  # for the checks below; the config is refused anyway
        batched, chunk = platform.step_tokens
        if self.max_batched_tokens is None:
            object.__setattr__(self, "max_batched_tokens", batched)
        if self.prefill_chunk_tokens is None:
            object.__setattr__(self, "prefill_chunk_tokens", chunk)
        for name in ("kv_budget_bytes", "max_num_seqs", "max_batched_tokens", "prefill_chunk_tokens", "max_sessions"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive")
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size not in PAGE_SIZES:
            problems.append(f"page_size must be one of {', '.join(map(str, PAGE_SIZES))} (the attention kernels' page sizes), "
                            f"got {self.page_size!r}")
        if self.dtype not in (*DTYPES, "auto"):
            problems.append(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {self.dtype!r}")
        if self.kv_dtype not in (None, "auto", *DTYPES):
            problems.append(f"kv_dtype must be one of {sorted(DTYPES)}, 'auto' or None, got {self.kv_dtype!r}")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", platform.default_dtype)
        dtype = DTYPES.get(self.dtype, torch.float32)
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            problems.append(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {self.quantization!r}")
        elif self.quantization == "auto":
            object.__setattr__(self, "quantization", platform.default_quantization(dtype))
        elif self.quantization is not None and (problem := platform.quantization_problem(self.quantization, dtype)):
            problems.append(problem)
        if self.kv_dtype == "auto":
            object.__setattr__(self, "kv_dtype", platform.default_kv_dtype(self.quantization))
        if self.decode_graphs is None:
            object.__setattr__(self, "decode_graphs", platform.captures_graphs)
        elif not isinstance(self.decode_graphs, bool):
            problems.append(f"decode_graphs must be a boolean or None, got {self.decode_graphs!r}")
        elif self.decode_graphs and self.deterministic:
            problems.append("decode_graphs pads decode steps to fixed batch sizes, which the deterministic mode's kernels do not take")
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", bool(self.decode_graphs) and platform.captures_graphs)
        elif not isinstance(self.async_scheduling, bool):
            problems.append(f"async_scheduling must be a boolean or None, got {self.async_scheduling!r}")
        elif self.async_scheduling and not self.decode_graphs:
            problems.append("async_scheduling launches decode steps over decode graphs' buffers: it needs decode_graphs")
        if not isinstance(self.deterministic, bool):
            problems.append(f"deterministic must be a boolean, got {self.deterministic!r}")
        elif self.deterministic and (problem := platform.deterministic_problem(dtype, DTYPES.get(self.kv_dtype or self.dtype, dtype))):
            problems.append(problem)
        if self.speculative == "auto":
            object.__setattr__(self, "speculative", platform.default_speculative)
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            problems.append(f"speculative must be one of {list(SPECULATIVE_METHODS)} or None, got {self.speculative!r}")
        tokens = self.num_speculative_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 1 <= tokens <= MAX_SPECULATIVE_TOKENS:
            problems.append(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {tokens!r}")
        if self.kv_policy not in POLICIES:
            problems.append(f"kv_policy must be one of {list(POLICIES)}, got {self.kv_policy!r}")
        if self.kv_codec not in CODECS:
            problems.append(f"kv_codec must be one of {list(CODECS)}, got {self.kv_codec!r}")
        mb = self.prefix_store_mb
        if not isinstance(mb, int) or isinstance(mb, bool) or mb < 0:
            problems.append(f"prefix_store_mb must be a non-negative integer (0: off), got {mb!r}")
        for name in ("kv_host_budget_mb", "kv_disk_budget_mb", "kv_stream_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.deterministic and self.kv_policy == "restore":
            problems.append("kv_policy 'restore' streams attention in chunks, which the deterministic mode's kernels do not")
        if self.snapshot_dir is not None and self.snapshot_store is not None:
            problems.append("set snapshot_dir or snapshot_store, not both")
        if not 0 < self.session_ttl_s < math.inf:  # NaN too: a snapshot's manifest must hold a finite TTL
            problems.append(f"session_ttl_s must be a positive, finite number of seconds, got {self.session_ttl_s}")
        if not 0 < self.generate_wait_s < math.inf:
            problems.append(f"generate_wait_s must be a positive number of seconds, got {self.generate_wait_s}")
        if problems:
            raise InvalidArgumentError("invalid engine config: " + "; ".join(problems))

    @property
    def platform(self) -> Platform:
        return Platform.of(self.device)

    @property
    def fused_kernels(self) -> bool:
        """Whether the model computes norms, RoPE and whole decoder layers with Kiln's fused CPU kernels
        (CausalLM.use_kernels): float32 on a CPU where they run."""
        return self.platform.fused_kernels(self.torch_dtype)

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
