"""Repetition, presence and frequency penalties: what a request's own tokens do to its next logits.

The rules are the peers':
- `repetition_penalty` r (HF transformers' RepetitionPenaltyLogitsProcessor, vLLM): every token that
  occurs in the sequence so far (the whole history, a session's earlier turns included, and the reply)
  has its logit divided by r when it is positive, multiplied by r otherwise. r = 1 is off.
- `presence_penalty` a_p and `frequency_penalty` a_f (OpenAI, vLLM): logit[j] -= c[j] * a_f +
  (c[j] > 0) * a_p, where c[j] counts how often this generation has produced token j so far (the reply
  only, not the prompt). 0 is off; negative values encourage repetition.

They apply in that order, after the grammar mask and the logit bias (vLLM's order) and before
temperature, top-k, top-p and min-p, and greedy decoding takes the argmax of the penalised logits. The
grammar mask commutes with them (a masked logit is -inf, and -inf times r or minus a finite amount is
still -inf), so constrained decoding only ever picks between tokens the grammar allows, whichever way round.

A request's counts live in a `Penalties`: the distinct tokens of its sequence (a list of ids and a map
from token to its place in it) and the reply's counts, made at its first sampled step from the history
(one scatter) and brought up to date from the tokens that joined since (one scatter per step, however
long the history): no loop over tokens. Which tokens are new is decided on the host (the map lives
there), so on a GPU bringing the counts up to date only queues copies and kernels: nothing waits for the
step's forward, still running when sampling starts (kiln/engine/transfers.py). Penalising gathers the
logits of those distinct tokens, changes them and writes them back, so a step costs what the sequence's
distinct tokens do, not what the vocabulary does (262k logits for Gemma 3). It exists only for a request
with a penalty on. Every operation is elementwise on the request's own rows, so a row's penalised logits
do not depend on its batch-mates, and are bit-identical whether the row is sampled alone or as a
speculative draft's row (batch invariance; deterministic mode needs nothing more).

A draft's rows (speculative verification): row i follows the draft's first i tokens, so those count as
generated for it, exactly as they would have had the tokens been decoded one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sampler import SamplingParams
from kiln.engine.transfers import to_device


@dataclass(eq=False)
class Penalties:
    """One request's token counts. `ids`: the distinct tokens of the sequence (history and reply);
    `column[j]`: j's place in `ids` (-1: absent), on the host; `counts[j]`: how many times the reply holds j
    (float32, exact below 2**24 tokens)."""

    ids: torch.Tensor  # [distinct] int64, on the logits' device
    column: torch.Tensor  # [vocab] int64, on the host
    counts: torch.Tensor  # [vocab] float32, on the logits' device
    history_seen: int = 0  # sequence tokens already in `ids`
    generated_seen: int = 0  # reply tokens already in `counts`

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device) -> Penalties:
        return cls(torch.zeros(0, dtype=torch.int64, device=device),
                   torch.full((vocab_size,), -1, dtype=torch.int64),
                   torch.zeros(vocab_size, dtype=torch.float32, device=device))

    def sync(self, tokens: list[int], generated: list[int]) -> None:
        """Count the tokens that joined since the last call (sequences and replies only grow)."""
        if len(tokens) > self.history_seen:
            fresh = self._absent(tokens[self.history_seen :])
            self.column[fresh] = torch.arange(len(self.ids), len(self.ids) + len(fresh))
            self.ids = torch.cat([self.ids, to_device(fresh, self.ids.device)])
            self.history_seen = len(tokens)
        if len(generated) > self.generated_seen:
            new = to_device(torch.tensor(generated[self.generated_seen :]), self.counts.device)
            self.counts.index_add_(0, new, torch.ones(len(new), device=self.counts.device))
            self.generated_seen = len(generated)

    def apply_(self, logits: torch.Tensor, params: SamplingParams) -> None:
        """Penalise the next token's [vocab] logits in place."""
        penalise_(logits, self.ids, None, self.counts[self.ids], params)

    def apply_draft_(self, rows: torch.Tensor, draft: list[int], params: SamplingParams) -> None:
        """Penalise a draft chunk's rows [len(draft) + 1, vocab] in place: row i also counts draft[:i] as
        generated (and present)."""
        fresh = self._absent(draft)  # sorted: a draft token's place among them by binary search
        ids = torch.cat([self.ids, to_device(fresh, rows.device)])
        num_rows, known = len(rows), len(self.ids)
        present = torch.zeros(num_rows, len(ids), dtype=torch.bool, device=rows.device)
        present[:, :known] = True
        counts = self.counts[ids].expand(num_rows, -1).clone()
        if draft:
            tokens = torch.tensor(draft)
            places = self.column[tokens]
            absent = places < 0
            places[absent] = known + torch.searchsorted(fresh, tokens[absent])
            places = to_device(places, rows.device)
            # (row, draft position) for every row after each draft position: the lower triangle below the diagonal
            row_ids, positions = torch.tril_indices(num_rows, len(draft), offset=-1, device=rows.device)
            present[row_ids, places[positions]] = True
            counts.index_put_((row_ids, places[positions]), torch.ones(len(row_ids), device=rows.device), accumulate=True)
        penalise_(rows, ids, present, counts, params)

    def _absent(self, tokens: list[int]) -> torch.Tensor:
        """The distinct tokens of `tokens` not yet in `ids`, sorted, on the host."""
        new = torch.tensor(tokens, dtype=torch.int64)
        return torch.unique(new[self.column[new] < 0])


def penalise_(logits: torch.Tensor, ids: torch.Tensor, present: torch.Tensor | None, counts: torch.Tensor,
              params: SamplingParams) -> None:
    """The module's rules on the columns `ids` of `logits` ([vocab] or [rows, vocab]), in place; `present`
    (None: all) and `counts` give, per row and column of `ids`, whether the token is in the sequence and
    how often the reply holds it. Plain and draft rows go through these same elementwise operations,
    hence the same bits (a column a row does not count is left as it is: where() keeps it, and x - 0 is x)."""
    values = logits[..., ids]
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        penalised = torch.where(values > 0, values / r, values * r)
        values = penalised if present is None else torch.where(present, penalised, values)
    if params.frequency_penalty:
        values = values - counts * params.frequency_penalty
    if params.presence_penalty:
        values = values - (counts > 0).to(values.dtype) * params.presence_penalty
    logits[..., ids] = values
