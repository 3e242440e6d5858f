"""Decode steps launched one ahead of their predecessor's tokens (async scheduling, EngineConfig.async_scheduling).

A GPU runs a captured decode step in a fraction of the time the engine's Python takes around it (sampling's
results back on the host, tokens joining histories, stop rules, events, the next schedule). So while a run of
plain decode steps goes on, the engine launches step N+1 straight from step N's sampled ids, still on the
device, and only then waits for step N's ids and processes them: its Python runs while the GPU computes N+1.

A step runs ahead only when nothing about it can depend on step N's tokens but the tokens themselves: every
row is a plain greedy decode (no grammar, penalties, logit bias, logprobs or draft, each reading the host's
state of the history), no request waits for admission or a resumed consumer, and none can reach max_tokens or
the context with N's token. A row whose request step N's token ends (a stop token or string) was computed for
nothing: its K/V past the history is dropped and its token never read, so the history and pages end as a
synchronous engine leaves them (tests/engine/test_run_ahead.py holds them to that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.engine.output import Sampled
from kiln.engine.scheduler import ScheduledChunk
from kiln.engine.sequence import Request


@dataclass
class LaunchedDecode:
    """A decode step whose sampled ids (one per chunk, in chunk order) are still on the device."""

    chunks: list[ScheduledChunk]
    ids: torch.Tensor  # [len(chunks)] long
    _host: torch.Tensor | None = field(default=None, repr=False)
    _ready: torch.cuda.Event | None = field(default=None, repr=False)

    def copy_out(self) -> None:
        """Start copying the ids to the host, queued before anything launched after this call."""
        if self.ids.device.type != "cuda":
            self._host = self.ids
            return
        self._host = torch.empty(self.ids.shape, dtype=self.ids.dtype, pin_memory=True)
        self._host.copy_(self.ids, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def sampled(self) -> list[list[Sampled]]:
        """Each chunk's token, once this step (not any launched after it) is done."""
        if self._ready is not None:
            self._ready.synchronize()
        return [[(token, None, None)] for token in self._host.tolist()]  # type: ignore[union-attr]

    def only(self, keep: list[int]) -> LaunchedDecode:
        """The same step reduced to the chunks at `keep` (the others' requests ended meanwhile)."""
        if len(keep) == len(self.chunks):
            return self
        index = torch.tensor(keep, dtype=torch.long, device=self.ids.device)
        return LaunchedDecode([self.chunks[i] for i in keep], self.ids.index_select(0, index))


def plain_greedy(request: Request, max_model_len: int) -> bool:
    """Whether the request's next token may be computed before its current one reaches the host: greedy, read
    from the logits alone, and sure to be wanted (a current token at max_tokens or the context ends it)."""
    params, seq = request.params, request.seq
    return (params.greedy and not params.logit_bias and not params.penalised and request.matcher is None
            and not params.logprobs and not params.top_logprobs and not seq.table.policy.tiered
            and not request.cancelled.is_set() and not request.paused.is_set()
            and len(request.generated) + 2 <= params.max_tokens and len(seq.tokens) + 2 <= max_model_len)
