"""A sequence (tokens + the pages holding their K/V) and a generation request running over it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.engine.sampler import SamplingParams
from kiln.errors import InvariantViolation
from kiln.kv.cache import KVCache
from kiln.kv.pages import PageTable, chain_hashes
from kiln.results import Usage

_ids = itertools.count(1)


@dataclass
class Sequence:
    """tokens[:num_computed] have K/V in `table`; the rest still need a forward pass. The last token of
    a finished generation is never computed until the next turn needs it."""

    tokens: list[int]
    table: PageTable
    num_computed: int = 0
    seq_id: int = field(default_factory=lambda: next(_ids))

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def check(self, cache: KVCache) -> None:
        """INV-1: the K/V held agrees with the tokens: enough pages for what is computed, none beyond,
        and every full page named by the chain hash of exactly these tokens."""
        ps = cache.page_size
        if not 0 <= self.num_computed <= len(self.tokens):
            raise InvariantViolation("inv1", f"{self.num_computed} computed of {len(self.tokens)} tokens")
        pages = -(-self.num_computed // ps)
        if any(len(group) != pages for group in self.table.pages):
            lengths = [len(group) for group in self.table.pages]
            raise InvariantViolation("inv1", f"page tables {lengths} for {self.num_computed} computed tokens")
        expected = chain_hashes(self.tokens[: (self.num_computed // ps) * ps], ps, cache.salt)
        if self.table.hashes != expected:
            raise InvariantViolation("inv1", "page hashes do not match the token history")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None


@dataclass(frozen=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    usage: Usage
    stop_string: str | None = None
    error: Exception | None = None


Event = TokenEvent | FinishEvent


@dataclass
class Request:
    """One generation over a sequence. `emit` runs on the engine thread and must not block. Its life
    is where it is held: the scheduler's waiting queue, then its running list, then (stateless requests)
    the engine's finished list until the next step releases the pages together; a session's request
    just ends, leaving the pages to the session."""

    seq: Sequence
    params: SamplingParams
    emit: Callable[[Event], None]
    keep_pages: bool  # a session's sequence keeps its pages when the request ends
    stop_token_ids: frozenset[int]
    request_id: int = field(default_factory=lambda: next(_ids))
    attached: bool = False
    prompt_tokens: int = 0
    reused_tokens: int = 0
    prefix_hit_tokens: int = 0  # of reused_tokens, those found in the prefix cache at admission
    generated: list[int] = field(default_factory=list)
    submitted_at: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    first_token_at: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            reused_tokens=self.reused_tokens,
            prefilled_tokens=self.prompt_tokens - self.reused_tokens,
            generated_tokens=len(self.generated),
        )
