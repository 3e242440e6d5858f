"""Repetition, presence and frequency penalties: what a request's own tokens do to its next logits.

The rules are the peers':
- `repetition_penalty` r (HF transformers' RepetitionPenaltyLogitsProcessor, vLLM): every token that
  occurs in the sequence so far (the whole history, a session's earlier turns included, and the reply)
  has its logit divided by r when it is positive, multiplied by r otherwise. r = 1 is off.
- `presence_penalty` a_p and `frequency_penalty` a_f (OpenAI, vLLM): logit[j] -= c[j] * a_f +
  (c[j] > 0) * a_p, where c[j] counts how often this generation has produced token j so far (the reply
  only, not the prompt). 0 is off; negative values encourage repetition.

They apply in that order, after the grammar mask and the logit bias (vLLM's order) and before
temperature, min-p, top-k and top-p, and greedy decoding takes the argmax of the penalised logits. The
grammar mask commutes with them (a masked logit is -inf, and -inf times r or minus a finite amount is
still -inf), so constrained decoding only ever picks between tokens the grammar allows, whichever way round.

A request's counts live in a `Penalties`: a presence mask over the vocabulary and the reply's counts,
made at its first sampled step from the history (one scatter) and brought up to date from the tokens
that joined since (one scatter per step, however long the history): no loop over tokens. It exists only
for a request with a penalty on. Every operation is elementwise on the request's own rows, so a row's
penalised logits do not depend on its batch-mates, and are bit-identical whether the row is sampled
alone or as a speculative draft's row (batch invariance; deterministic mode needs nothing more).

A draft's rows (speculative verification): row i follows the draft's first i tokens, so those count as
generated for it, exactly as they would have had the tokens been decoded one at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.engine.sampler import SamplingParams


@dataclass(eq=False)
class Penalties:
    """One request's token counts. `present[j]`: token j occurs in the sequence (history and reply);
    `counts[j]`: how many times the reply holds it (float32, exact below 2**24 tokens)."""

    present: torch.Tensor  # [vocab] bool
    counts: torch.Tensor  # [vocab] float32
    history_seen: int = 0  # sequence tokens already in `present`
    generated_seen: int = 0  # reply tokens already in `counts`

    @classmethod
    def empty(cls, vocab_size: int, device: torch.device) -> Penalties:
        return cls(torch.zeros(vocab_size, dtype=torch.bool, device=device),
                   torch.zeros(vocab_size, dtype=torch.float32, device=device))

    def sync(self, tokens: list[int], generated: list[int]) -> None:
        """Count the tokens that joined since the last call (sequences and replies only grow)."""
        if len(tokens) > self.history_seen:
            self.present[torch.tensor(tokens[self.history_seen :], device=self.present.device)] = True
            self.history_seen = len(tokens)
        if len(generated) > self.generated_seen:
            new = torch.tensor(generated[self.generated_seen :], device=self.counts.device)
            self.counts.index_add_(0, new, torch.ones(len(new), device=self.counts.device))
            self.generated_seen = len(generated)

    def apply(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """[rows, vocab] or [vocab] logits, every row following the sequence as counted: new logits."""
        return penalise(logits, self.present, self.counts, params)

    def apply_draft(self, rows: torch.Tensor, draft: list[int], params: SamplingParams) -> torch.Tensor:
        """A draft chunk's rows [len(draft) + 1, vocab]: row i also counts draft[:i] as generated."""
        num_rows = len(rows)
        present = self.present.expand(num_rows, -1).clone()
        counts = self.counts.expand(num_rows, -1).clone()
        if draft:
            # (row, column) for every row after each draft column: the lower triangle below the diagonal.
            row_ids, columns = torch.tril_indices(num_rows, len(draft), offset=-1, device=rows.device)
            token_ids = torch.tensor(draft, device=rows.device)[columns]
            present[row_ids, token_ids] = True
            counts.index_put_((row_ids, token_ids), torch.ones(len(row_ids), device=rows.device), accumulate=True)
        return penalise(rows, present, counts, params)


def penalise(logits: torch.Tensor, present: torch.Tensor, counts: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The module's rules on logits, `present` and `counts` broadcasting against them. Plain and draft
    rows go through these same elementwise operations, hence the same bits."""
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        logits = torch.where(present, torch.where(logits > 0, logits / r, logits * r), logits)
    if params.frequency_penalty:
        logits = logits - counts * params.frequency_penalty
    if params.presence_penalty:
        logits = logits - (counts > 0).to(logits.dtype) * params.presence_penalty
    return logits
