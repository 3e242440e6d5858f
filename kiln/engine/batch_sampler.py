"""BatchSampler: a step's tokens picked on the device that computed its logits, every row at once.

The host's Sampler (kiln/engine/sampler.py) draws row by row and reads each token back: on a GPU a handful
of small kernels and a wait per row. Here the rows' parameters become tensors, `probabilities` makes the
cuts of `Sampler.probabilities` (temperature, top-k, softmax, top-p keeping the token that crosses the mass
and always the likeliest, min-p; the same order and semantics) on the whole batch, and one exponential race
draws every row: argmax(p / E) with E ~ Exp(1) independent per token picks token j with probability
p_j / sum(p). A seeded request's noise comes from its own generator on the device, so its tokens do not
depend on its batch-mates; unseeded rows share one draw. The chosen ids, their logprobs and the top
alternatives (the model's distribution, as on the host) come back in one copy (`to_host`), the step's only
read of the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.output import Sampled
from kiln.engine.sampler import Sampler, SamplingParams, argmax
from kiln.engine.transfers import to_device, to_host


@dataclass(frozen=True)
class Cuts:
    """The sampled rows' parameters as [rows] tensors on the logits' device, values as the host compares
    them (float32)."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64 in [1, vocab]; vocab: no cut
    top_p: torch.Tensor  # float32; inf: no cut
    min_p: torch.Tensor  # float32; 0: no cut
    by_rank: bool  # some row cuts by top-k or top-p, which needs its row sorted

    @classmethod
    def of(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> Cuts:
        """The cuts of rows that sample (not greedy): one copy to the device, which waits for nothing."""
        columns = [[p.temperature for p in params], [min(p.top_k or vocab_size, vocab_size) for p in params],
                   [p.top_p if p.top_p < 1 else float("inf") for p in params], [p.min_p for p in params]]
        temperature, top_k, top_p, min_p = to_device(torch.tensor(columns, dtype=torch.float32), device)
        by_rank = any(p.top_k or p.top_p < 1 for p in params)
        return cls(temperature, top_k.long(), top_p, min_p, by_rank)


def probabilities(logits: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    """[rows, vocab] float32 logits -> the (unnormalised) distributions the rows are sampled from: row i is
    `Sampler.probabilities` of row i with its parameters. Top-k and top-p cut on the row sorted once (the
    scaled logits' order is the probabilities'), and the result goes back to token order."""
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / cuts.temperature[:, None]
    if not cuts.by_rank:
        probs = torch.softmax(scaled, dim=-1)
        return probs.masked_fill(probs < cuts.min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    ranked, order = scaled.sort(dim=-1, descending=True)
    kth = ranked.gather(1, cuts.top_k[:, None] - 1)
    probs = torch.softmax(ranked.masked_fill(ranked < kth, float("-inf")), dim=-1)
    outside = probs.cumsum(dim=-1) - probs >= cuts.top_p[:, None]  # the mass before it already reaches top_p
    outside[:, 0] = False  # the likeliest token always stays, however small top_p is
    probs = probs.masked_fill(outside | (probs < cuts.min_p[:, None] * probs[:, :1]), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of [rows, vocab] probabilities by an exponential race; row i's noise from
    `generators[i]`, or from one draw shared by the rows without one."""
    noise = torch.empty_like(probs)
    if None in generators:
        noise.exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    return (probs / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


@dataclass
class DeviceSample:
    """A step's picks still on the device: `ids` [B] long, and `packed` [B, columns] int32, everything the step
    returns (BatchSampler.sample), to read back in one copy."""

    ids: torch.Tensor
    packed: torch.Tensor
    params: list[SamplingParams]
    most: int  # top alternatives packed per row

    def select(self, keep: list[int]) -> DeviceSample:
        """The rows at `keep` only."""
        index = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        return DeviceSample(self.ids.index_select(0, index), self.packed.index_select(0, index),
                            [self.params[row] for row in keep], self.most)

    def results(self, host: torch.Tensor) -> list[Sampled]:
        """Per row what the step returns, from `packed` copied to the host."""
        return results(host, self.params, self.most)


class BatchSampler:
    """Samples a step's rows on their device. Seeded requests' generators live in `sampler`, which
    forgets them with their requests."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[int]
               ) -> list[Sampled]:
        """logits: [B, vocab]. Per row (token, its logprob if asked, its top alternatives if asked), logprobs
        under the model's distribution (before temperature and truncation)."""
        picked = self.launch(logits, params, request_ids)
        return picked.results(to_host(picked.packed))

    def launch(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[int]) -> DeviceSample:
        """`sample`'s picks, left on the device: nothing is read back (kiln/engine/run_ahead.py launches the
        next step from `ids` before they reach the host)."""
        logits = logits.float()
        chosen = argmax(logits)
        rows = [row for row, p in enumerate(params) if not p.greedy]
        if rows:
            chosen = self._sample_rows(logits, chosen, rows, params, request_ids)
        most = max(p.top_logprobs for p in params)
        columns = [chosen.to(torch.int32)[:, None]]
        if most or any(p.logprobs for p in params):
            logprobs = torch.log_softmax(logits, dim=-1)
            columns.append(logprobs.gather(1, chosen[:, None]).view(torch.int32))
            if most:
                values, ids = logprobs.topk(most, dim=-1)
                columns += [ids.to(torch.int32), values.view(torch.int32)]
        return DeviceSample(chosen, torch.cat(columns, dim=1), params, most)

    def _sample_rows(self, logits: torch.Tensor, chosen: torch.Tensor, rows: list[int],
                     params: list[SamplingParams], request_ids: list[int]) -> torch.Tensor:
        """`chosen` with the rows that sample (not greedy) drawn instead."""
        device = logits.device
        generators = [self.sampler.generator(request_ids[row], params[row].seed, device) for row in rows]
        cuts = Cuts.of([params[row] for row in rows], logits.shape[-1], device)
        if len(rows) == len(params):
            return draw(probabilities(logits, cuts), generators)
        index = to_device(torch.tensor(rows), device)
        return chosen.index_copy(0, index, draw(probabilities(logits[index], cuts), generators))


def results(host: torch.Tensor, params: list[SamplingParams], most: int) -> list[Sampled]:
    """What the step returns per row, from the host copy of [B, columns] int32: the token, then (if any
    row asked) its logprob's float32 bits, then `most` top ids and `most` top logprobs' bits."""
    tokens = host[:, 0].tolist()
    logprobs = host[:, 1].view(torch.float32).tolist() if host.shape[1] > 1 else None
    top_ids = host[:, 2 : 2 + most].tolist()
    top_values = host[:, 2 + most :].view(torch.float32).tolist()
    return [(token, logprobs[row] if logprobs and p.logprobs else None,
             tuple(zip(top_ids[row][: p.top_logprobs], top_values[row][: p.top_logprobs], strict=True))
             if p.top_logprobs else None)
            for row, (token, p) in enumerate(zip(tokens, params, strict=True))]
