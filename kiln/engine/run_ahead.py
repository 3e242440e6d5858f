"""Decode steps launched one ahead of their predecessor's tokens (async scheduling, EngineConfig.async_scheduling).

A GPU runs a captured decode step in a fraction of the time the engine's Python takes around it (sampling's
results back on the host, tokens joining histories, stop rules, events, the next schedule). So while a run of
plain decode steps goes on, the engine launches step N+1 straight from step N's sampled ids, still on the
device, and only then waits for step N's ids and processes them: its Python runs while the GPU computes N+1.

A step runs ahead only when nothing about it can depend on step N's tokens but the tokens themselves: every
row is a plain decode (no grammar, penalties or draft, each reading the host's state of the history; on the
CPU, where the host's Sampler draws, greedy), its token picked on the device (BatchSampler.launch), no request
waits for admission or a resumed consumer, and none can reach max_tokens or the context with N's token. A row whose request step N's token ends (a stop token or string) was computed for
nothing: its K/V past the history is dropped and its token never read, so the history and pages end as a
synchronous engine leaves them (tests/engine/test_run_ahead.py holds them to that).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.engine.batch_sampler import DeviceSample
from kiln.engine.output import Sampled
from kiln.engine.scheduler import ScheduledChunk
from kiln.engine.sequence import Request
from kiln.engine.transfers import HostCopy


@dataclass
class LaunchedDecode:
    """A decode step whose picks (one per chunk, in chunk order) are still on the device."""

    chunks: list[ScheduledChunk]
    picked: DeviceSample
    _copy: HostCopy | None = field(default=None, repr=False)

    @property
    def ids(self) -> torch.Tensor:
        return self.picked.ids

    def copy_out(self) -> None:
        """Start copying the picks to the host, queued before anything launched after this call."""
        self._copy = HostCopy(self.picked.packed)

    def sampled(self) -> list[list[Sampled]]:
        """Each chunk's token (with what its request asked of it), once this step, not any launched after it,
        is done."""
        return [[row] for row in self.picked.results(self._copy.wait())]  # type: ignore[union-attr]

    def only(self, keep: list[int]) -> LaunchedDecode:
        """The same step reduced to the chunks at `keep` (the others' requests ended meanwhile)."""
        if len(keep) == len(self.chunks):
            return self
        return LaunchedDecode([self.chunks[i] for i in keep], self.picked.select(keep))


def runs_ahead(request: Request, max_model_len: int, on_host: bool) -> bool:
    """Whether the request's next token may be computed before its current one reaches the host: read from the
    logits and the request's fixed parameters alone (no grammar or penalties, whose state the current token
    moves), sure to be wanted (a current token at max_tokens or the context ends it), and, where the host
    samples (`on_host`: its Sampler draws row by row there), greedy, so that its tokens are the Sampler's."""
    params, seq = request.params, request.seq
    return ((params.greedy or not on_host) and not params.penalised and request.matcher is None
            and not seq.table.policy.tiered and not request.cancelled.is_set() and not request.paused.is_set()
            and len(request.generated) + 2 <= params.max_tokens and len(seq.tokens) + 2 <= max_model_len)
