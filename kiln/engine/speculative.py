"""Speculative decoding from a sequence's own history: prompt-lookup (n-gram) drafts, verified k at a time.

Drafts: the longest n-gram (MAX_NGRAM down to MIN_NGRAM tokens) that ends the history and occurred earlier
in it proposes the tokens that followed its most recent earlier occurrence. Agents repeat tool output, file
contents and code, and a session holds its whole history, so such drafts are often right and cost nothing
to make: an index of every n-gram's last occurrence is kept per sequence and updated with the new tokens
only, so a proposal costs O(1) whatever the history.

Verification: the draft rides in the sequence's next decode chunk (its K/V written past the computed
tokens), the step returns logits for each of its rows, and `verify` keeps the draft's longest prefix the
model agrees with plus one token of the model's own. Greedy decoding agrees by argmax, so its output is
the one-token-at-a-time output exactly. Sampling uses speculative rejection sampling for a draft that is a
point mass: accept draft token d with probability p(d), else draw from p with d removed and stop, which
leaves every output token distributed by p. The engine then rolls the rejected rows' K/V back
(KVCache.drop, which never writes a shared or named page).

Cost: a rejected draft makes a step compute k + 1 rows instead of one, and the LM head's arithmetic grows
with the rows (bench/speculation.py measures what that costs a turn). After a
draft of which nothing was accepted a sequence stops proposing for 1, 2, 4 ... up to MAX_COOLDOWN
steps, and any acceptance resets that. The pause belongs to the sequence and outlives a request, so a
session whose drafts never land, turn after turn, carries one in MAX_COOLDOWN steps at most.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kiln.engine.sampler import Sampler, SamplingParams, argmax
from kiln.engine.sequence import Request, Sequence

MIN_NGRAM, MAX_NGRAM = 2, 4  # one repeated token predicts little; longer matches are tried first
MAX_COOLDOWN = 64  # steps without drafts after repeated misses


class NgramIndex:
    """For each n-gram length, the end of the most recent occurrence of every n-gram in a token list
    (an end at which a following token exists), indexed up to `indexed`."""

    def __init__(self) -> None:
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
        self._indexed = 0

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest n-gram ending
        `tokens`; [] when none recurs. Tokens only ever grow (histories are append-only)."""
        for end in range(self._indexed, len(tokens)):
            for n, last in self._last.items():
                if end >= n:
                    last[tuple(tokens[end - n : end])] = end
        self._indexed = len(tokens)
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            end = self._last[n].get(tuple(tokens[-n:])) if len(tokens) > n else None
            if end is not None:
                return tokens[end : end + limit]
        return []


@dataclass
class _Backoff:
    cooldown: int = 0  # steps to pause after the next miss, doubled per miss
    wait: int = 0  # steps left in the current pause


class NgramProposer:
    """Drafts for decode steps: an index and a backoff per sequence, kept across a session's turns and
    held weakly, so they go with their sequence."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self._indices: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()
        self._backoff: weakref.WeakKeyDictionary[Sequence, _Backoff] = weakref.WeakKeyDictionary()

    def propose(self, request: Request, limit: int) -> list[int]:
        """A draft of at most min(num_tokens, limit) tokens to follow the request's uncomputed last token."""
        backoff = self._backoff.setdefault(request.seq, _Backoff())
        if backoff.wait:
            backoff.wait -= 1
            return []
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return []
        index = self._indices.get(request.seq)
        if index is None:
            index = self._indices[request.seq] = NgramIndex()
        return index.draft(request.seq.tokens, limit)

    def feedback(self, request: Request, proposed: int, accepted: int) -> None:
        backoff = self._backoff.setdefault(request.seq, _Backoff())
        if accepted:
            backoff.cooldown = 0
        elif proposed:
            backoff.cooldown = min(max(1, 2 * backoff.cooldown), MAX_COOLDOWN)
            backoff.wait = backoff.cooldown


def verify(logits: torch.Tensor, draft: list[int], params: SamplingParams, sampler: Sampler, request_id: int) -> list[int]:
    """logits [len(draft) + 1, vocab]: row i follows the draft's first i tokens. Returns the accepted
    draft prefix and one more token from the model (at least one token, at most len(draft) + 1)."""
    if params.greedy:
        best = argmax(logits).tolist()
        accepted = next((i for i, token in enumerate(draft) if best[i] != token), len(draft))
        return [*draft[:accepted], best[accepted]]
    out: list[int] = []
    for row, token in enumerate(draft):
        probs = sampler.probabilities(logits[row], params)
        if float(sampler.uniform(request_id, params.seed, logits.device)) < float(probs[token]):
            out.append(token)
            continue
        probs[token] = 0.0  # the residual max(0, p - q) for a point-mass draft q
        return [*out, sampler.draw(probs, request_id, params.seed)]
    return [*out, sampler.draw(sampler.probabilities(logits[len(draft)], params), request_id, params.seed)]
