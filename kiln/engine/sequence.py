"""A sequence (tokens + the pages holding their K/V) and a generation request running over it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.engine.constraints import Matcher
from kiln.engine.penalties import Penalties
from kiln.engine.sampler import SamplingParams
from kiln.kv.pages import PageTable
from kiln.results import Usage

_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    """tokens[:num_computed] have K/V in `table`; the rest still need a forward pass. The last token of
    a finished generation is never computed until the next turn needs it. A session's sequence
    (`session=True`) keeps its pages between requests until the engine needs them back; a stateless
    one gives them back when its request ends. Compared by identity: tokens can be long."""

    tokens: list[int]
    table: PageTable
    session: bool = False
    num_computed: int = 0
    closed: bool = False  # its session ended while a request ran: release the pages when it finishes
    owner: str | None = None  # its session's API key identity: the scheduler's fair share is per owner
    session_id: str | None = None  # its session's id (the dashboard's in-flight requests name it)
    # Positions its attention no longer reads (KVPolicy.forgotten: sink_window only), the most so far:
    # kept when its K/V is given back for room, so a recompute does not count them again.
    forgotten_tokens: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] | None = None  # likeliest alternatives (id, logprob), when asked


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    stop_string: str | None = None
    error: Exception | None = None


Event = TokenEvent | FinishEvent


@dataclass(eq=False)
class Request:
    """One generation over a sequence. `emit` runs on the engine thread, never under the engine lock,
    and must not block. Its life is where it is held: the scheduler's waiting queue, then its running
    list, then (stateless requests) the engine's finished list until the next step releases the pages
    together; a session's request just ends, leaving its sequence parked with its pages."""

    seq: Sequence
    params: SamplingParams
    emit: Callable[[Event], None]
    stop_token_ids: frozenset[int]
    matcher: Matcher | None = None  # the grammar the generated text must match (params.constraint)
    # Whose share of the batch slots it takes (kiln/engine/scheduler.py § Fair shares): an API key's
    # identity, or on a server without keys its connection; None is the in-process API, one caller.
    caller: str | None = None
    request_id: int = field(default_factory=lambda: next(_ids))
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefix_hit_tokens: int = 0  # of reused_tokens, those found in the prefix cache at admission
    fetch_tried: bool = False  # its admission looked for its prompt in the persistent prefix store
    generated: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set while the consumer cannot take more tokens (a client that stopped reading): the scheduler sets
    # the request aside, its pages kept, until cleared (kiln/engine/stream.py § Backpressure).
    paused: threading.Event = field(default_factory=threading.Event)
    stalled: bool = False  # cancelled because it stayed paused past its stall timeout
    penalties: Penalties | None = None  # its token counts, once a penalised request first samples

    def penalty_counts(self, vocab_size: int, device: torch.device) -> Penalties:
        """The request's token counts, brought up to date with its sequence (made on first use)."""
        if self.penalties is None:
            self.penalties = Penalties.empty(vocab_size, device)
        self.penalties.sync(self.seq.tokens, self.generated)
        return self.penalties

    def settle_usage(self) -> Usage:
        """The usage its finish event reports. A request that ends before its admission counted its
        prompt has its whole history as prompt and its computed tokens as reused."""
        if not self.prompt_tokens:
            self.prompt_tokens = len(self.seq.tokens) - len(self.generated)
            self.reused_tokens = self.seq.num_computed
        return self.usage()

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            prefilled_tokens=self.prompt_tokens - self.reused_tokens,
            generated_tokens=len(self.generated),
        )

    def in_flight(self, state: str, now: float) -> InFlight:
        """What the dashboard lists of it while the engine holds it (`now`: time.perf_counter())."""
        seq = self.seq
        prompt = len(seq.tokens) - len(self.generated)
        return InFlight(
            request_id=self.request_id, session_id=seq.session_id, owner=seq.owner if seq.session else self.caller,
            state=state, age_s=now - self.submitted_at,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.submitted_at,
            prompt_tokens=prompt, computed_tokens=min(seq.num_computed, prompt),
            generated_tokens=len(self.generated), max_tokens=self.params.max_tokens,
        )


@dataclass(frozen=True)
class InFlight:
    """A request queued, running or paused now (Engine.in_flight): the dashboard's live table."""

    request_id: int
    session_id: str | None  # None: a stateless request
    owner: str | None  # its session's owner, or (stateless) its caller: who may see it
    state: str  # "queued" | "running" | "paused" (its client stopped reading)
    age_s: float  # since it was submitted
    ttft_s: float | None  # submission to first token; None before it
    prompt_tokens: int  # the history it started from
    computed_tokens: int  # of the prompt, tokens whose K/V is computed (prefill progress)
    generated_tokens: int
    max_tokens: int
