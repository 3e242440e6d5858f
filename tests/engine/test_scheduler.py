"""Scheduling without a model: fair token budgets, admission, and where pages come from under pressure.
A step is simulated: the chunks' tokens count as computed and committed, decode rows grow by a token."""

import torch

from kiln.engine.sampler import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Request, Sequence
from kiln.engine.stats import EngineStats
from kiln.kv.cache import KVCache
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable
from kiln.models.config import ModelConfig

PS = 4


def make_scheduler(num_pages: int, budget: int = 64, chunk: int = 64, max_num_seqs: int = 8) -> Scheduler:
    config = ModelConfig("llama", 1000, 8, 16, 1, 2, 1, 4)
    layout = KVLayout.for_model(config, PS)
    cache = KVCache(layout, num_pages, KVCodec("none", layout, torch.float32), "cpu", KVFormat("m", "f", "f", "raw", PS))
    return Scheduler(cache, max_num_seqs, budget, chunk, EngineStats())


def request(tokens: list[int], session: bool = False) -> Request:
    return Request(Sequence(list(tokens), PageTable.empty(1), session), SamplingParams(max_tokens=100), lambda event: None, frozenset())


def step(scheduler: Scheduler) -> dict[Request, int]:
    chunks = scheduler.schedule()
    for chunk in chunks:
        seq = chunk.request.seq
        samples = chunk.samples
        seq.num_computed += chunk.num_tokens
        scheduler.cache.commit(seq.table, seq.tokens, seq.num_computed)
        if samples:
            seq.tokens.append(5)
    return {chunk.request: chunk.num_tokens for chunk in chunks}


def test_short_request_runs_at_once_beside_a_long_prefill():
    scheduler = make_scheduler(num_pages=1000, budget=64)
    long = request(list(range(1, 1001)))
    scheduler.add(long)
    assert step(scheduler) == {long: 64}  # alone, a prefill takes the whole step
    short = request([7, 8, 9])
    scheduler.add(short)
    assert step(scheduler) == {short: 3, long: 61}  # the newcomer's whole prompt, the rest to the long one
    assert step(scheduler) == {short: 1, long: 63}  # decode rows first, every step
    late = request(list(range(2000, 2100)))  # a second long prompt gets at most half while one runs
    scheduler.add(late)
    assert step(scheduler) == {short: 1, late: 31, long: 32}
    assert step(scheduler) == {short: 1, late: 63}  # the prefill with the fewest tokens left goes first
    assert step(scheduler) == {short: 1, late: 6, long: 57}


def test_no_prompt_takes_more_than_a_chunk_of_a_step():
    scheduler = make_scheduler(num_pages=1000, budget=64, chunk=16)
    long, other = request(list(range(1, 1001))), request(list(range(2000, 2040)))
    scheduler.add(long)
    assert step(scheduler) == {long: 16}  # short steps even alone: a newcomer waits at most one of them
    scheduler.add(other)
    assert step(scheduler) == {other: 16, long: 16}
    short = request([7, 8, 9])
    scheduler.add(short)
    assert step(scheduler) == {short: 3, other: 16, long: 16}


def test_a_waiting_request_pins_no_cached_pages():
    """A queued request whose reservation fails gives back the prefix pages it attached, so a running
    request can still evict them instead of failing."""
    scheduler = make_scheduler(num_pages=10, budget=64)
    prefix = list(range(1, 9))
    done = request(prefix + [50])
    scheduler.add(done)
    step(scheduler)
    scheduler.remove(done)
    scheduler.cache.release(done.seq.table)  # 2 named pages cached, the rest free
    running = request(list(range(100, 128)))  # 7 pages with the next token
    scheduler.add(running)
    step(scheduler)
    waiting = request(prefix + list(range(60, 72)))  # 2 cached pages + 3 more: does not fit now
    scheduler.add(waiting)
    step(scheduler)
    assert waiting in scheduler.waiting and not waiting.seq.table.holds_pages
    assert scheduler.cache.usage().cached == 2  # back in the cache, where eviction can reach them
    for _ in range(8):  # the running request grows into the cached pages, page after page
        step(scheduler)
    assert not scheduler.failed
    assert running in scheduler.running and waiting in scheduler.waiting
    assert not waiting.seq.table.holds_pages and waiting.seq.num_computed == 0


def test_pressure_drops_parked_kv_first_then_preempts_the_latest_admitted():
    scheduler = make_scheduler(num_pages=12, budget=64)
    idle = request(list(range(1, 18)), session=True)  # 5 pages
    scheduler.add(idle)
    step(scheduler)
    scheduler.remove(idle)
    scheduler.park(idle.seq)
    first, second = request(list(range(200, 215))), request(list(range(300, 315)))  # 4 pages each
    scheduler.add(first)
    scheduler.add(second)
    assert set(step(scheduler)) == {first, second}
    assert not idle.seq.table.holds_pages and idle.seq.num_computed == 0  # its K/V went, its tokens stay
    assert len(idle.seq.tokens) == 18 and scheduler.stats.kv_dropped_tokens["idle"] == 17
    while not scheduler.stats.preemptions:
        step(scheduler)
    assert scheduler.running == [first] and scheduler.waiting[0] is second  # requeued, not failed
    assert scheduler.stats.kv_dropped_tokens["preempted"] > 0 and not scheduler.failed


def test_a_running_request_with_nothing_later_to_preempt_preempts_itself():
    scheduler = make_scheduler(num_pages=8, budget=64)
    first, second = request(list(range(1, 14))), request(list(range(100, 114)))  # 4 pages each
    scheduler.add(first)
    step(scheduler)
    scheduler.add(second)
    step(scheduler)
    second.seq.tokens.extend(range(3))  # second now needs a fifth page first
    step(scheduler)
    assert not scheduler.failed and scheduler.stats.preemptions == 1
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]


def test_only_a_request_larger_than_the_pool_fails():
    scheduler = make_scheduler(num_pages=3, budget=64)
    huge = request(list(range(1, 30)))
    scheduler.add(huge)
    step(scheduler)
    assert [r for r, _ in scheduler.failed] == [huge] and "KV cache exhausted" in str(scheduler.failed[0][1])
