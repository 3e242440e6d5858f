"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import InvalidArgumentError

GREEDY_BELOW_TEMPERATURE = 1e-5  # colder sampling is argmax in effect (and may round to 0 in float32)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 (or below 1e-5) means greedy; a seed makes sampling
    reproducible per request whatever else shares the batch."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the decoded generated text
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    logprobs: bool = False  # report the log-probability of each chosen token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            problems.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            problems.append(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            problems.append("stop strings must be non-empty")
        if problems:
            raise InvalidArgumentError("; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


class Sampler:
    """Picks one token per row of logits. Each seeded request owns a generator, so its samples do not
    depend on which other requests share the step."""

    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, request_id: int) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[int]
    ) -> tuple[list[int], list[float] | None]:
        """logits: [B, vocab] float32. Returns the chosen ids and, if any request asked, their logprobs
        under the model's distribution (before temperature and truncation)."""
        chosen = logits.argmax(dim=-1)
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not p.greedy:
                chosen[row] = self._sample_row(logits[row], p, request_id)
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        return chosen.tolist(), logprobs

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, request_id: int) -> int:
        scaled = (logits - logits.max()) / p.temperature  # <= 0 everywhere: no overflow at low temperature
        if p.top_k:
            kth = torch.topk(scaled, min(p.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest set whose mass reaches top_p (the token crossing it included).
            outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            outside[0] = False  # the likeliest token always stays, however small top_p is
            probs = probs.scatter(0, order[outside], 0.0)
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, p.seed)))

    def _generator(self, request_id: int, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(seed)
        return self._generators[request_id]
