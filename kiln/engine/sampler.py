"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, per-request seeds.
Repetition, presence and frequency penalties change the logits before this (kiln/engine/penalties.py)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from kiln.engine.constraints import MAX_LOGIT_BIAS, Constraint
from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels
from kiln.platform import Platform
from kiln.tokenizer import check_unicode

GREEDY_BELOW_TEMPERATURE = 1e-5  # colder sampling is argmax in effect (and may round to 0 in float32)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_TOP_LOGPROBS = 20  # alternatives reported per position (OpenAI's limit)
INT32_MAX = 2**31 - 1  # counts (max_tokens, top_k) fit the wire's int32 fields
MAX_REPETITION_PENALTY = 100.0  # keeps penalised logits finite (a logit of -1e36 times 100 is still a float32)
MAX_OPENAI_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
# logit_bias entries per request (OpenAI's limit): each is checked per request and applied to its rows
# every step, so an unbounded map is a way to slow the server for everyone.
MAX_LOGIT_BIAS_ENTRIES = 300


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
    top_logprobs: int = 0  # also report the most likely alternatives at each position, at most MAX_TOP_LOGPROBS
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value in [-100, 100]) added to its logit
    constraint: Constraint | None = None  # the text must match it (kiln/engine/constraints.py)
    min_p: float = 0.0  # keep tokens whose probability is >= min_p x the likeliest's (0 = no cut)
    repetition_penalty: float = 1.0  # > 0; tokens of the history and the reply: logit / it if > 0, else x it (1 = off)
    presence_penalty: float = 0.0  # in [-2, 2]; subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # in [-2, 2]; subtracted per time a token was generated so far

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        object.__setattr__(self, "stop", tuple(stop) if isinstance(stop, Iterable) else stop)
        if isinstance(self.stop_token_ids, Iterable):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        if isinstance(bias, Iterable):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) if isinstance(pair, Iterable) else pair for pair in bias))
        problems = [(param, problem) for param, problem in self._problems() if problem]
        if problems:
            raise InvalidArgumentError("; ".join(problem for _, problem in problems), problems[0][0])

    def _problems(self) -> Iterator[tuple[str, str | None]]:
        yield "max_tokens", _integer_in("max_tokens", self.max_tokens, 1, INT32_MAX)
        yield "temperature", _number_in("temperature", self.temperature, 0.0, 100.0, low_open=False)
        yield "top_k", _integer_in("top_k", self.top_k, 0, INT32_MAX)
        yield "top_p", _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        yield "min_p", _number_in("min_p", self.min_p, 0.0, 1.0, low_open=False)
        yield "repetition_penalty", _number_in("repetition_penalty", self.repetition_penalty, 0.0,
                                               MAX_REPETITION_PENALTY, low_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            yield name, _number_in(name, getattr(self, name), -MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY, low_open=False)
        if self.seed is not None:
            yield "seed", _integer_in("seed", self.seed, *SEED_RANGE)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            yield "stop", f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
        elif len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            yield "stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters"
        else:
            yield "stop", _unicode_problem(self.stop)
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_integer(t) for t in self.stop_token_ids):
            yield "stop_token_ids", f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
        if not isinstance(self.ignore_eos, bool) or not isinstance(self.logprobs, bool):
            yield "ignore_eos", "ignore_eos and logprobs must be booleans"
        yield "top_logprobs", _integer_in("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)
        if isinstance(self.logit_bias, tuple) and len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            yield "logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries, got {len(self.logit_bias)}"
        elif not isinstance(self.logit_bias, tuple) or not all(_is_bias(pair) for pair in self.logit_bias):
            yield "logit_bias", (f"logit_bias must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                 f"got {self.logit_bias!r:.200}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            yield "constraint", f"constraint must be a Constraint, got {type(self.constraint).__name__}"

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def penalised(self) -> bool:
        """Whether the request's own tokens change its logits (kiln/engine/penalties.py)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_bias(pair: object) -> bool:
    return (isinstance(pair, tuple) and len(pair) == 2 and _is_integer(pair[0]) and _number_in("", pair[1],
            -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, low_open=False) is None)


def _unicode_problem(texts: tuple[str, ...]) -> str | None:
    try:
        for index, text in enumerate(texts):
            check_unicode(text, f"stop[{index}]")
    except InvalidArgumentError as error:
        return str(error)
    return None


def _integer_in(name: str, value: object, low: int, high: int | None) -> str | None:
    if _is_integer(value) and low <= value and (high is None or value <= high):  # type: ignore[operator]
        return None
    bound = f">= {low}" if high is None else f"in [{low}, {high}]"
    return f"{name} must be an integer {bound}, got {value!r}"


def _number_in(name: str, value: object, low: float, high: float, low_open: bool) -> str | None:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if real and (low < value if low_open else low <= value) and value <= high:  # type: ignore[operator]
        return None
    return f"{name} must be a number in {'(' if low_open else '['}{low:g}, {high:g}], got {value!r}"


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, vocab] -> [B] long: each row's first largest logit (torch.argmax's answer). On an AVX2 CPU one
    kernel call on the kernels' thread pool, whose workers are already awake, unlike torch's OpenMP team."""
    if logits.dtype == torch.float32 and Platform.of(logits.device).kernels:
        return kernels().argmax_rows(logits)
    return logits.argmax(dim=-1)


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
        chosen = argmax(logits)
        for row, (p, request_id) in enumerate(zip(params, request_ids, strict=True)):
            if not p.greedy:
                chosen[row] = self._sample_row(logits[row], p, request_id)
        logprobs = None
        if any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        return chosen.tolist(), logprobs

    def _sample_row(self, logits: torch.Tensor, p: SamplingParams, request_id: int) -> int:
        return self.draw(self.probabilities(logits, p), request_id, p.seed)

    def probabilities(self, logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """The distribution a row is sampled from: [vocab] logits after temperature, top-k, top-p and min-p
        (HF transformers' order; min-p compares with the likeliest token, which every cut keeps, so it
        is the same cut before or after the others)."""
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
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs

    def draw(self, probs: torch.Tensor, request_id: int, seed: int | None) -> int:
        """One token from (unnormalised) probabilities, with the request's generator when it has a seed."""
        generator = self.generator(request_id, seed, probs.device)
        if generator is not None:  # drawn where its generator lives (a device's, once the BatchSampler made it)
            probs = probs.to(generator.device)
        return int(torch.multinomial(probs, 1, generator=generator))

    def uniform(self, request_id: int, seed: int | None, device: torch.device | str = "cpu") -> float:
        """A uniform draw in [0, 1) from the request's generator (speculative acceptance tests)."""
        generator = self.generator(request_id, seed, device)
        return float(torch.rand(1, generator=generator, device=device if generator is None else generator.device))

    def generator(self, request_id: int, seed: int | None,
                  device: torch.device | str = "cpu") -> torch.Generator | None:
        """The request's own generator (made on `device` at its first draw), or None without a seed."""
        if seed is None:
            return None
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[request_id]


def top_logprobs(logits: torch.Tensor, counts: list[int]) -> list[tuple[tuple[int, float], ...] | None]:
    """Per row, its `counts[row]` most likely tokens as (id, logprob), likeliest first, from the same
    distribution as the chosen token's logprob; None for rows that asked for none."""
    most = max(counts, default=0)
    if not most:
        return [None] * len(counts)
    values, ids = torch.log_softmax(logits, dim=-1).topk(most, dim=-1)
    return [tuple(zip(ids[row, :k].tolist(), values[row, :k].tolist(), strict=True)) if k else None
            for row, k in enumerate(counts)]
