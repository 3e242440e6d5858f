"""StepSampler: the tokens of one step's sampling chunks from its logits.

A plain chunk samples one token from its row; a chunk carrying a speculative draft verifies it against
its rows (kiln/engine/speculative.py) and yields the draft's accepted prefix plus one token. Grammar
masks and logit biases apply to every row first (kiln/engine/constraints.py), then the request's
repetition, presence and frequency penalties (kiln/engine/penalties.py). Plain rows on the host are
sampled by the Sampler, row by row; on a device by the BatchSampler, all at once there, reading back
only what the step returns. A failure fails only the request it belongs to: the result for that chunk
is the exception.
"""

from __future__ import annotations

import logging
from itertools import accumulate

import torch

from kiln.engine.batch_sampler import BatchSampler, DeviceSample
from kiln.engine.constraints import Matcher, constrain
from kiln.engine.output import Sampled
from kiln.engine.sampler import Sampler, top_logprobs
from kiln.engine.scheduler import ScheduledChunk
from kiln.engine.sequence import Request
from kiln.engine.speculative import verify
from kiln.engine.transfers import to_device
from kiln.platform import Platform

logger = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.batch = BatchSampler(sampler)  # plain rows on a device

    def sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[list[Sampled] | Exception]:
        """Each sampling chunk's tokens: one sampled from its row, or a draft's verified prefix plus one.
        `logits` holds 1 + len(draft) rows per chunk, in chunk order."""
        starts = list(accumulate([0, *(1 + len(c.draft) for c in chunks)]))
        plain = [i for i, c in enumerate(chunks) if not c.draft]
        results: list[list[Sampled] | Exception] = [[] for _ in chunks]
        if plain:
            # Every row a plain chunk's (no drafts in the step): the logits as they are, no 1 MB-per-row copy.
            rows = logits
            if len(plain) < len(logits):
                rows = logits[to_device(torch.tensor([starts[i] for i in plain]), logits.device)]
            sampled = self._sample_plain(rows, [chunks[i].request for i in plain])
            for i, result in zip(plain, sampled, strict=True):
                results[i] = result if isinstance(result, Exception) else [result]
        for i, chunk in enumerate(chunks):
            if chunk.draft:
                try:
                    results[i] = self._verify(chunk, logits[starts[i] : starts[i + 1]])
                except Exception as error:
                    logger.exception("verifying a draft failed")
                    results[i] = error
        return results

    def launch(self, requests: list[Request], logits: torch.Tensor) -> DeviceSample:
        """One token per request from its row of `logits`, picked where they are and not read back
        (kiln/engine/run_ahead.py): for requests with neither a grammar nor penalties, whose rows need nothing
        of the host's but their logit bias."""
        shaped = constrain(logits, [None] * len(requests), [r.params.logit_bias for r in requests])
        return self.batch.launch(shaped, [r.params for r in requests], [r.request_id for r in requests])

    def _verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[Sampled]:
        request, params = chunk.request, chunk.request.params
        shaped = constrain(rows, [None] * len(rows), [params.logit_bias] * len(rows))
        if params.penalised:
            shaped = writable(shaped, rows)
            request.penalty_counts(rows.shape[-1], rows.device).apply_draft_(shaped, chunk.draft, params)
        rows = shaped
        if request.matcher is not None:
            rows = mask_draft_rows(request.matcher, rows, chunk.draft)
        tokens = verify(rows, chunk.draft, params, self.sampler, request.request_id)
        rows = rows[: len(tokens)]
        logprobs = torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist() if params.logprobs else None
        tops = top_logprobs(rows, [params.top_logprobs] * len(tokens))
        return [(token, logprobs[i] if logprobs else None, tops[i]) for i, token in enumerate(tokens)]

    def _sample_plain(self, logits: torch.Tensor, requests: list[Request]) -> list[Sampled | Exception]:
        """(token, logprob or None, top alternatives or None) per request. Should sampling the batch fail
        (a bug), each row is sampled alone, so only the request whose sampling fails fails."""
        try:
            return self._sample_rows(logits, requests)
        except Exception:
            logger.exception("sampling a batch failed; sampling its rows one by one")
        sampled: list[Sampled | Exception] = []
        for row, request in enumerate(requests):
            try:
                sampled += self._sample_rows(logits[row : row + 1], [request])
            except Exception as error:
                sampled.append(error)
        return sampled

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[Sampled]:
        shaped = constrain(logits, [r.matcher for r in requests], [r.params.logit_bias for r in requests])
        if any(request.params.penalised for request in requests):
            shaped = writable(shaped, logits)
            penalise_rows(shaped, requests)
        logits = shaped
        if not Platform.of(logits.device).on_host:
            return self.batch.sample(logits, [r.params for r in requests], [r.request_id for r in requests])
        token_ids, logprobs = self.sampler.sample(logits, [r.params for r in requests], [r.request_id for r in requests])
        tops = top_logprobs(logits, [r.params.top_logprobs for r in requests])
        return [(token, logprobs[row] if logprobs and request.params.logprobs else None, tops[row])
                for row, (token, request) in enumerate(zip(token_ids, requests, strict=True))]


def writable(shaped: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """What penalties may change in place: `shaped` when constrain made new logits, else a copy of the
    step's own `logits` (never changed: a failed batch is sampled again row by row). On the CPU the copy
    is one NumPy pass in this thread, as constraints._blocked's and for its reason (a busy machine)."""
    if shaped is not logits:
        return shaped
    if Platform.of(logits.device).on_host and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().copy())
    return logits.clone()


def penalise_rows(logits: torch.Tensor, requests: list[Request]) -> None:
    """Each penalised request's row of [B, vocab] `logits` penalised, in place."""
    for row, request in enumerate(requests):
        if request.params.penalised:
            request.penalty_counts(logits.shape[-1], logits.device).apply_(logits[row], request.params)


def mask_draft_rows(matcher: Matcher, rows: torch.Tensor, draft: list[int]) -> torch.Tensor:
    """Row i of a draft's logits masked by the grammar as it stands after the draft's first i tokens.
    A draft token the grammar refuses is masked out of its row, so verification rejects it there and
    never reads the rows after it (left unmasked). The matcher ends as it began: the accepted tokens
    advance it again when they join the sequence."""
    rows = rows.clone()
    advanced = 0
    for i in range(len(rows)):
        rows[i : i + 1] = constrain(rows[i : i + 1], [matcher], [()])
        if i == len(draft) or not matcher.accept(draft[i]):
            break
        advanced += 1
    matcher.rollback(advanced)
    return rows
