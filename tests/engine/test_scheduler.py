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


def make_scheduler(num_pages: int, budget: int = 64, chunk: int = 64, max_num_seqs: int = 8,
                   max_seqs_per_caller: int | None = None) -> Scheduler:
    config = ModelConfig("llama", 1000, 8, 16, 1, 2, 1, 4)
    layout = KVLayout.for_model(config, PS)
    cache = KVCache(layout, num_pages, KVCodec("none", layout, torch.float32), "cpu", KVFormat("m", "f", "f", "raw", PS))
    return Scheduler(cache, max_num_seqs, budget, chunk, EngineStats(), max_seqs_per_caller=max_seqs_per_caller)


def request(tokens: list[int], session: bool = False, caller: str | None = None) -> Request:
    return Request(Sequence(list(tokens), PageTable.empty(1), session), SamplingParams(max_tokens=100), lambda event: None,
                   frozenset(), caller=caller)


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


def add_and_step(scheduler: Scheduler, *requests: Request) -> dict[Request, int]:
    for r in requests:
        scheduler.add(r)
    return step(scheduler)


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
    add_and_step(scheduler, first)
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


# ---- fair shares of the batch slots ------------------------------------------------------------------

def test_a_newcomer_gets_a_slot_at_once_from_a_caller_holding_every_one():
    """One caller's long generations hold every slot and more wait; another caller's request runs in the
    very next step: the hog's most recently admitted request is requeued first in its line."""
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=4)
    hog = [request([10 + i, 11, 12], caller="hog") for i in range(6)]
    add_and_step(scheduler, *hog)
    assert scheduler.running == hog[:4]
    bystander = request([7, 8, 9], caller="bystander")
    scheduler.add(bystander)
    assert bystander in step(scheduler)
    assert scheduler.running == [*hog[:3], bystander]
    assert list(scheduler.waiting) == [hog[3], *hog[4:]] and scheduler.stats.fair_share_preemptions == 1
    assert not hog[3].seq.table.holds_pages and scheduler.stats.preemptions == 0  # not a preemption for room
    for _ in range(5):  # one slot apart: nothing moves back and forth
        step(scheduler)
    assert scheduler.running == [*hog[:3], bystander] and scheduler.stats.fair_share_preemptions == 1


def test_slots_even_out_between_callers_and_stay_put():
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=6)
    hog = [request([10 + i, 11], caller="a") for i in range(8)]
    add_and_step(scheduler, *hog)
    others = [request([50 + i, 51], caller="b") for i in range(5)]
    add_and_step(scheduler, *others)
    assert [r.caller for r in scheduler.running].count("a") == 3 and [r.caller for r in scheduler.running].count("b") == 3
    for _ in range(4):
        step(scheduler)
    assert scheduler.stats.fair_share_preemptions == 3


def test_the_queue_is_served_by_caller_not_by_arrival():
    """Hundreds queued by one caller (OpenAI's n x prompts) do not keep a later caller waiting behind
    them: as slots free, the caller holding the fewest goes first."""
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=2)
    first = request([10, 11], caller="a")
    add_and_step(scheduler, first)
    queued = [request([20 + i, 21], caller="a") for i in range(5)]
    add_and_step(scheduler, *queued)
    late = request([7, 8], caller="b")
    add_and_step(scheduler, late)  # a holds both slots, b none: one of a's goes back
    assert late in scheduler.running and scheduler.stats.fair_share_preemptions == 1


def test_a_cap_keeps_slots_from_one_caller_even_alone():
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=4, max_seqs_per_caller=2)
    hog = [request([10 + i, 11], caller="hog") for i in range(4)]
    add_and_step(scheduler, *hog)
    assert scheduler.running == hog[:2]  # two slots stay free
    bystander = request([7, 8], caller="bystander")
    add_and_step(scheduler, bystander)
    assert scheduler.running == [*hog[:2], bystander] and scheduler.stats.fair_share_preemptions == 0


def test_one_caller_alone_takes_every_slot():
    scheduler = make_scheduler(num_pages=1000, max_num_seqs=4)
    mine = [request([10 + i, 11]) for i in range(6)]
    add_and_step(scheduler, *mine)
    assert scheduler.running == mine[:4] and list(scheduler.waiting) == mine[4:]
