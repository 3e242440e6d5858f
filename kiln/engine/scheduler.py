"""Scheduler: which requests run this step and how many tokens each, and where their pages come from.

Every step shares the token budget fairly: decode rows first (one token each), then newly arrived
requests, then running prefills with the rest, the one with the fewest tokens left first. No prompt
takes more than `prefill_chunk` tokens of a step, so steps stay short and a long prompt moves on in
chunks around short requests; while a prefill runs, new arrivals may take at most half the step, so
neither side starves (vLLM's chunked-prefill policy, with shortest-remaining-first among prefills so a
medium prompt admitted beside a huge one is not stuck behind it).

Pages come from the KV cache. When it runs dry the order is docs/architecture.md's: evict cached pages (the cache
does that by itself), drop the K/V of parked session sequences least recently used first, then of other
waiting requests, then preempt the most recently admitted running request (its pages stay cached, so it
resumes from the prefix cache); a running request with nothing later-admitted to preempt preempts
itself, and a waiting one waits while anything runs. Only a request that cannot fit the pool alone
fails. Histories are never touched: dropped K/V is recomputed (or found in the prefix cache) when needed.

With the persistent prefix store on (`stored`, kiln/engine/stored_prefixes.py), a request whose prompt the
store holds past the pool's prefix has its pages fetched before it is admitted: it waits out of the steps
(others are admitted past it, and a step runs without it) until they arrive or its patience runs out; a
prefill under way takes fetched pages that land between its steps.

A request whose consumer stopped taking tokens (`Request.paused`, set by its stream's Backpressure) leaves
the running list at the next step for `paused`: it takes no step, no `max_num_seqs` slot and no share of
the budget, so a client that never reads holds up no one. It keeps its pages, but they are the first
running work's pages given back for room (after idle sessions'). Resumed, it queues again at the front:
it was admitted before anything waiting.

Fair shares: the `max_num_seqs` slots are shared by caller (`Request.caller`: an API key, a connection on
a server without keys), as the pool's pages are by owner. Of the waiting requests, the first of the caller
holding the fewest slots is admitted next, so a caller with hundreds queued (OpenAI's `n` times 32
prompts) does not keep a newcomer behind them. When every slot is taken and a waiting caller holds at
least two fewer than the caller holding the most, that caller's most recently admitted request is
requeued at the front of the queue (its pages stay cached, so it resumes from the prefix cache) and the
waiting one takes its slot at once: a newcomer waits a step, not for someone else's long generations to
end. The rule is work-conserving, so a caller alone may take every slot, and stable: slots differing by
one never move. `max_seqs_per_caller`, when set, caps what any one caller holds even alone.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kiln.engine.sequence import Request, Sequence
from kiln.engine.stats import EngineStats
from kiln.engine.stored_prefixes import StoredPrefixes
from kiln.errors import ResourceExhaustedError
from kiln.kv.cache import KVCache

# Drafts ride only in steps of at most this many decoding sequences. A draft's rows are close to free
# while a step is bound by reading the weights (few rows); with more sequences the step is bound by
# arithmetic, and every draft row costs what a sequence's row does, most of it in the LM head (every draft
# row needs logits). bench/README.md § speculation.py gives the agents' figures that chose 4.
MAX_DRAFTING_SEQUENCES = 4


@dataclass
class ScheduledChunk:
    """`num_tokens` rows of a request: its next uncomputed tokens, then (decode rows) a speculative draft."""

    request: Request
    num_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the sequence: its last row's logits give the next token (and each
        draft row's logits check the draft)."""
        return self.num_tokens - len(self.draft) == self.request.seq.uncomputed


class Room(Enum):
    OK = "ok"
    WAIT = "wait"  # a waiting request stays queued until running ones free pages
    GONE = "gone"  # the request was preempted or failed while making room


class Scheduler:
    def __init__(
        self, cache: KVCache, max_num_seqs: int, max_batched_tokens: int, prefill_chunk: int, stats: EngineStats,
        propose: Callable[[Request, int], list[int]] | None = None, max_seqs_per_caller: int | None = None,
    ) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_seqs_per_caller = max_seqs_per_caller or max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.stats = stats
        self.propose = propose  # a draft of at most n tokens for a decode row (speculative decoding), or None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.parked: OrderedDict[int, Sequence] = OrderedDict()  # idle session sequences, least recently used first
        self.paused: list[Request] = []  # set aside until their consumers read again
        self.failed: list[tuple[Request, Exception]] = []
        self.stored: StoredPrefixes | None = None  # the persistent prefix store, when the engine has one
        self._chunks: dict[Request, int] = {}
        self._drafts: dict[Request, list[int]] = {}
        self._budget = 0

    def add(self, request: Request) -> None:
        self.parked.pop(request.seq.seq_id, None)
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Something to step: a running request, a queued one not waiting for its fetch, or a paused one
        resumed or cancelled."""
        return (bool(self.running) or any(not self._fetching(r) or r.cancelled.is_set() for r in self.waiting)
                or any(not r.paused.is_set() or r.cancelled.is_set() for r in self.paused))

    def _fetching(self, request: Request) -> bool:
        return self.stored is not None and self.stored.waiting(request)

    def requests(self) -> list[Request]:
        """Every request the scheduler holds: waiting, running or paused."""
        return [*self.waiting, *self.running, *self.paused]

    def remove(self, request: Request) -> None:
        for holder in (self.running, self.waiting, self.paused):
            if request in holder:
                holder.remove(request)
                return

    def park(self, seq: Sequence) -> None:
        """A session sequence is idle (or was just used): it keeps its pages, most recently used last."""
        if seq.table.holds_pages:
            self.parked[seq.seq_id] = seq
            self.parked.move_to_end(seq.seq_id)

    def unpark(self, seq: Sequence) -> None:
        self.parked.pop(seq.seq_id, None)

    # ---- one step -----------------------------------------------------------------------------------

    def schedule(self) -> list[ScheduledChunk]:
        self._settle_pauses()
        self._budget = self.max_batched_tokens
        self._chunks, self._drafts = {}, {}
        if self.stored is not None:  # fetched pages that landed during a prefill
            for request in self.running:
                request.reused_tokens += self.stored.apply(request)
        decodes = [r for r in self.running if r.seq.uncomputed == 1]
        prefills = sorted((r for r in self.running if r.seq.uncomputed > 1), key=lambda r: r.seq.uncomputed)
        drafting = len(decodes) <= MAX_DRAFTING_SEQUENCES
        for request in decodes:
            self._schedule_decode(request, drafting)
        prefill_share = min(self.max_batched_tokens // 2, sum(self._chunk(r) for r in prefills))
        self._admit(reserve=prefill_share)
        for request in prefills:
            self._schedule_running(request, min(self._chunk(request), self._budget))
        return [ScheduledChunk(request, size, self._drafts.get(request, [])) for request, size in self._chunks.items()]

    def _settle_pauses(self) -> None:
        """Requests whose consumers paused them step aside; resumed ones queue first in line."""
        for request in [r for r in (*self.running, *self.waiting) if r.paused.is_set()]:
            self.remove(request)
            self.paused.append(request)
            self.stats.pauses += 1
        for request in [r for r in self.paused if not r.paused.is_set()][::-1]:
            self.paused.remove(request)
            self.waiting.appendleft(request)
        self.stats.paused_now = len(self.paused)

    def _schedule_decode(self, request: Request, drafting: bool) -> None:
        """One row, plus a draft when one is proposed and its pages are free without dropping anyone's
        K/V: a draft is a bet, never worth a preemption."""
        if request not in self.running:  # preempted for an earlier one
            return
        draft = self.propose(request, self._budget - 1) if drafting and self.propose and self._budget > 1 else []
        seq = request.seq
        if draft and self.cache.ensure(seq.table, seq.num_computed + 1 + len(draft)):
            self._chunks[request] = 1 + len(draft)
            self._drafts[request] = draft
            self._budget -= 1 + len(draft)
        else:
            self._schedule_running(request, 1)

    def _schedule_running(self, request: Request, size: int) -> None:
        if size <= 0 or size > self._budget or request not in self.running:  # preempted for an earlier one
            return
        if self._reserve(request, size, admitting=False) is Room.OK:
            self._chunks[request] = size
            self._budget -= size

    def _admit(self, reserve: int) -> None:
        while self._budget > reserve and (request := self._next_admission()) is not None:
            if self.stored is not None and self.stored.begin(request):
                continue  # it waits for its pages out of this step (`_next_admission` passes it by)
            attached = self._attach(request)
            size = min(self._chunk(request), self._budget - reserve)
            room = self._reserve(request, size, admitting=True)
            if room is Room.GONE:
                continue
            if room is Room.WAIT:
                if attached:  # a waiting request pins no pages it took from the prefix cache
                    self.cache.release(request.seq.table)
                    request.seq.num_computed = 0
                return
            self.waiting.remove(request)
            request.admitted_at = request.admitted_at or time.perf_counter()
            self.running.append(request)
            self._chunks[request] = size
            self._budget -= size

    def _next_admission(self) -> Request | None:
        """The waiting request to admit next, with a slot for it (the module docstring's fair shares):
        the first queued of the callers under their cap holding the fewest slots. With every slot taken,
        the caller holding the most gives one up if it holds at least two more; else None."""
        held = Counter(r.caller for r in self.running)
        request = min((r for r in self.waiting if held[r.caller] < self.max_seqs_per_caller and not self._fetching(r)),
                      key=lambda r: held[r.caller], default=None)  # the first of equals: queue order
        if request is None or len(self.running) < self.max_num_seqs:
            return request
        most = max(held.values())
        if most < held[request.caller] + 2:
            return None
        self._preempt(next(r for r in reversed(self.running) if held[r.caller] == most), fair=True)
        return request

    def _chunk(self, request: Request) -> int:
        return min(request.seq.uncomputed, self.prefill_chunk)

    def _attach(self, request: Request) -> bool:
        """Give the request what K/V it can have without computing: its own (a session's), the prefix
        cache's and then its fetch's (the persistent prefix store's), or, when every token is computed,
        all but the last (its logits are needed). True when pages were taken from the prefix cache or the
        fetch."""
        seq = request.seq
        attached, restored = False, 0
        if seq.num_computed == 0 and not seq.table.holds_pages:
            seq.num_computed = self.cache.attach(seq.table, seq.tokens)
            if not request.prompt_tokens:
                request.prefix_hit_tokens = seq.num_computed
            restored = self.stored.apply(request) if self.stored is not None else 0
            attached = seq.num_computed > 0
        elif seq.uncomputed == 0:
            seq.num_computed = self.cache.drop(seq.table, seq.num_computed - 1)
        if not request.prompt_tokens:
            request.prompt_tokens = len(seq.tokens)
            request.reused_tokens = seq.num_computed
        else:  # admitted again (preempted, or it waited for room): what it restores now it did not compute
            request.reused_tokens += restored
        return attached

    # ---- making room --------------------------------------------------------------------------------

    def _reserve(self, request: Request, size: int, admitting: bool) -> Room:
        """Pages for the request's next `size` tokens, making room as the module docstring says."""
        seq = request.seq
        while not self.cache.ensure(seq.table, seq.num_computed + size):
            if self._drop_parked() or self._drop_waiting(request):
                continue
            if admitting:
                if self.running:
                    return Room.WAIT
            else:
                victim = next((r for r in reversed(self.running) if r is not request), None)
                if victim is not None and self.running.index(victim) > self.running.index(request):
                    self._preempt(victim)
                    continue
                if victim is not None:  # everything else running was admitted earlier
                    self._preempt(request)
                    return Room.GONE
            self._fail(request, seq.num_computed + size)
            return Room.GONE
        return Room.OK

    def _drop_parked(self) -> bool:
        if not self.parked:
            return False
        seq = self._parked_victim()
        del self.parked[seq.seq_id]
        self._drop(seq, "idle")
        return True

    def _parked_victim(self) -> Sequence:
        """Whose idle K/V goes first: the least recently used parked sequence of an owner (API key) holding
        more pages than its fair share of the pool (pool pages / owners holding pages), else the least
        recently used one. With one owner nobody is over its share: plain LRU. Stateless requests count
        as the owner None."""
        live = [*self.parked.values(), *(r.seq for r in self.requests())]
        lru = next(iter(self.parked.values()))
        if len({seq.owner for seq in live}) < 2:
            return lru
        held: Counter[str | None] = Counter()
        for seq in live:
            held[seq.owner] += len(seq.table.resident())
        share = self.cache.num_pages / sum(1 for pages in held.values() if pages)
        return next((seq for seq in self.parked.values() if held[seq.owner] > share), lru)

    def _drop_waiting(self, request: Request) -> bool:
        """The K/V of a paused request (its client is not reading), else of a queued one, latest first."""
        for reason, others in (("paused", self.paused), ("waiting", reversed(self.waiting))):
            for other in others:
                if other is not request and other.seq.table.holds_pages:
                    self._drop(other.seq, reason)
                    return True
        return False

    def _preempt(self, request: Request, fair: bool = False) -> None:
        """Requeue a running request first in line. For room (`fair` False) its K/V counts as dropped;
        for another caller's share (`fair`) its pages just go back, most of them to the prefix cache."""
        self.running.remove(request)
        self._budget += self._chunks.pop(request, 0)
        self._drop(request.seq, None if fair else "preempted")
        if fair:
            self.stats.fair_share_preemptions += 1
        else:
            self.stats.preemptions += 1
        self.waiting.appendleft(request)

    def _drop(self, seq: Sequence, reason: str | None) -> None:
        """Give the sequence's pages back; `reason`: for room, counted as EngineStats.kv_dropped_tokens."""
        if reason is not None:
            self.stats.kv_dropped_tokens[reason] += seq.num_computed
        self.cache.release(seq.table)
        seq.num_computed = 0

    def _fail(self, request: Request, num_tokens: int) -> None:
        self.remove(request)
        needed = self.cache.pages_needed(request.seq.table, num_tokens)
        self.failed.append(
            (
                request,
                ResourceExhaustedError(
                    f"KV cache exhausted: {needed} more pages needed for {num_tokens} tokens, "
                    f"{self.cache.available()} of {self.cache.num_pages} available after eviction"
                ),
            )
        )
