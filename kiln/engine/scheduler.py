"""Scheduler: which requests run this step and how many tokens each, within a token budget.

Decode rows and running prefills go first, then waiting requests are admitted in arrival order.
Pages come from the KV cache; when it runs dry the order is DESIGN.md's: evict cached pages (the pool
does that by itself), ask the owner of idle sequences to give some up (`reclaim`), preempt the most
recently admitted other request (its pages stay cached, so it resumes from the prefix cache), and only
then fail the request with a capacity error. A running sequence is never partly overwritten.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kiln.engine.sequence import Request
from kiln.errors import ResourceExhaustedError
from kiln.kv.cache import KVCache


@dataclass
class ScheduledChunk:
    request: Request
    num_tokens: int


class Scheduler:
    def __init__(
        self, cache: KVCache, max_num_seqs: int, max_batched_tokens: int, reclaim: Callable[[], bool]
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.reclaim = reclaim
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.failed: list[tuple[Request, Exception]] = []
        self.preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request not in self.running:  # preempted while making room for an earlier one
                continue
            size = min(request.seq.uncomputed, budget)
            if self._reserve(request, size, chunks):
                chunks.append(ScheduledChunk(request, size))
                budget -= size
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.attached:
                self._attach(request)
            size = min(request.seq.uncomputed, budget)
            if not self._reserve(request, size, chunks, admitting=True):
                break
            self.waiting.popleft()
            request.admitted_at = request.admitted_at or time.perf_counter()
            self.running.append(request)
            chunks.append(ScheduledChunk(request, size))
            budget -= size
        return chunks

    def _attach(self, request: Request) -> None:
        seq = request.seq
        if seq.num_computed == 0 and not seq.table.resident():
            match = self.cache.match(seq.tokens)
            self.cache.attach(seq.table, match)
            seq.num_computed = match.num_tokens
            if not request.prompt_tokens:
                request.prefix_hit_tokens = match.num_tokens
        elif seq.uncomputed == 0:
            seq.num_computed = self.cache.rewind(seq.table, seq.num_computed)
        request.attached = True
        if not request.prompt_tokens:
            request.prompt_tokens = len(seq.tokens)
            request.reused_tokens = seq.num_computed

    def _reserve(self, request: Request, size: int, scheduled: list[ScheduledChunk], admitting: bool = False) -> bool:
        """Make sure the request has pages for its next `size` tokens, freeing room if needed. False when
        it must wait (admission) or was preempted/failed (running)."""
        seq = request.seq
        while not self.cache.ensure(seq.table, seq.num_computed + size):
            if self.reclaim():
                continue
            victim = self._victim(request, scheduled)
            if victim is not None:
                self._preempt(victim)
                continue
            if admitting and self.running:
                return False  # wait for running requests to finish and free pages
            self._fail(request, seq.num_computed + size)
            return False
        return True

    def _victim(self, request: Request, scheduled: list[ScheduledChunk]) -> Request | None:
        """The most recently admitted running request other than `request` not yet in this step."""
        in_step = {chunk.request.request_id for chunk in scheduled}
        for candidate in reversed(self.running):
            if candidate is not request and candidate.request_id not in in_step:
                return candidate
        return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.release(request.seq.table)
        request.seq.num_computed = 0
        request.attached = False
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _fail(self, request: Request, num_tokens: int) -> None:
        self.remove(request)
        pool = self.cache.pool
        needed = self.cache.pages_needed(request.seq.table, num_tokens)
        self.failed.append(
            (
                request,
                ResourceExhaustedError(
                    f"KV cache exhausted: {needed} more pages needed for {num_tokens} tokens, "
                    f"{pool.available()} of {pool.num_pages} available after eviction"
                ),
            )
        )
