"""Engine behaviour on tiny random models: batching, chunking, prefix reuse, capacity, cancellation."""

import threading
import time

import numpy as np
import pytest
import torch

from kiln import SamplingParams
from kiln.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kiln.server.service import RuntimeService

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (length + 5 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_equals_alone(tiny_llm, arch):
    llm = tiny_llm(arch)
    batch = prompts(4, 9)
    together = [o.token_ids for o in llm.generate(batch, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in batch]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_chunked_prefill_gives_same_tokens(tiny_llm):
    prompt = prompts(1, 45)[0]
    whole = tiny_llm("gemma3").generate(prompt, GREEDY)[0].token_ids
    chunked = tiny_llm("gemma3", max_batched_tokens=7).generate(prompt, GREEDY)[0].token_ids
    assert whole == chunked


def test_prefix_shared_with_finished_request_recomputes_from_first_different_page(tiny_llm):
    llm = tiny_llm("llama", page_size=4)
    first = prompts(1, 22)[0]
    out = llm.generate(first, GREEDY)[0]
    assert out.usage.reused_tokens == 0 and out.usage.prefilled_tokens == 22
    second = first[:10] + [7, 7, 7, 7, 7, 7]  # differs inside page 2 (positions 8..11)
    usage = llm.generate(second, GREEDY)[0].usage
    assert usage.reused_tokens == 8 and usage.prefilled_tokens == 8
    stats = llm.engine.stats
    assert stats.prefill_tokens == 22 + 8


def test_prompt_longer_than_context_and_bad_ids_are_refused(tiny_llm):
    llm = tiny_llm("llama", max_model_len=32)
    with pytest.raises(InvalidArgumentError, match="context"):
        llm.generate(list(range(3, 40)), GREEDY)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        llm.generate([5, 10_000], GREEDY)
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        llm.generate([5, 6], max_tokens=0)
    assert llm.engine.kv_usage().used == 0


def test_request_larger_than_pool_is_a_capacity_error(tiny_llm):
    llm = tiny_llm("llama", page_size=4, kv_pages=6)
    with pytest.raises(ResourceExhaustedError, match="KV pages"):
        llm.generate(prompts(1, 30)[0], GREEDY)
    assert len(llm.generate(prompts(1, 5)[0], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_cancel_frees_the_sequence(tiny_llm):
    llm = tiny_llm("llama", page_size=4)
    session = llm.create_session(prompts(1, 10)[0])
    stream = session.generate(max_tokens=10_000, ignore_eos=True)
    next(stream)
    stream.cancel()
    result = stream.result()
    assert result.finish_reason == "cancelled"
    assert not session.info().generating
    llm.generate([1, 2, 3], max_tokens=1)  # the loop keeps serving
    stateless = llm.engine
    with stateless._lock:
        stateless._release_finished()
    session.close()
    assert llm.engine.kv_usage().used == 0


def test_stop_strings_stop_tokens_and_logprobs(tiny_llm):
    llm = tiny_llm("llama")
    prompt = prompts(1, 8)[0]
    free = llm.generate(prompt, GREEDY)[0]
    stop_token = free.token_ids[3]
    stopped = llm.generate(prompt, GREEDY, stop_token_ids=(stop_token,))[0]
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    assert stopped.finish_reason == "stop"
    text = llm.tokenizer.decode(free.token_ids)
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    by_string = llm.generate(prompt, GREEDY, stop=(needle,))[0]
    assert by_string.finish_reason == "stop" and needle not in by_string.text
    with_logprobs = llm.generate(prompt, GREEDY, logprobs=True)[0]
    assert with_logprobs.logprobs is not None and len(with_logprobs.logprobs) == 12
    assert all(lp <= 0 for lp in with_logprobs.logprobs)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    llm = tiny_llm("llama")
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    prompt = prompts(1, 6)[0]
    alone = llm.generate(prompt, params)[0].token_ids
    together = llm.generate([prompt] + prompts(3, 7, seed=9), params)[0].token_ids
    assert alone == together
    other_seed = llm.generate(prompt, params, seed=99)[0].token_ids
    assert other_seed != alone
    greedy_by_top_k = llm.generate(prompt, params, top_k=1)[0].token_ids
    assert greedy_by_top_k == llm.generate(prompt, max_tokens=10, ignore_eos=True)[0].token_ids


def test_stop_string_late_in_a_long_reply_decodes_only_a_tail(tiny_llm, monkeypatch):
    """A stop string first seen far into the reply stops it on the token that completes it, and each
    step's check decodes a bounded tail rather than the whole reply so far."""
    llm = tiny_llm("llama")
    prompt = prompts(1, 8)[0]
    long = SamplingParams(max_tokens=200, temperature=1.0, seed=7, ignore_eos=True)  # greedy loops
    free = llm.generate(prompt, long)[0].token_ids
    decode = llm.tokenizer.decode
    late = len(decode(free[:150]))
    text = decode(free)
    needle = next(text[i : i + 5] for i in range(late, len(text)) if text.index(text[i : i + 5]) >= late)
    decoded_lengths: list[int] = []

    def counting_decode(ids, *args, **kwargs):
        decoded_lengths.append(len(list(ids)))
        return decode(list(ids), *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", counting_decode)
    stopped = llm.generate(prompt, long, stop=(needle,))[0]
    monkeypatch.undo()
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) > 150
    assert needle in decode(stopped.token_ids) and needle not in decode(stopped.token_ids[:-1])
    assert max(decoded_lengths[:-1]) < 40  # the last decode is the output's .text, the whole reply


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(tiny_llm, monkeypatch):
    llm = tiny_llm("llama", page_size=4)
    session = llm.create_session(prompts(1, 10)[0])
    sample = llm.engine._sampler.sample

    def broken(*args, **kwargs):
        raise RuntimeError("a sampler bug")

    monkeypatch.setattr(llm.engine._sampler, "sample", broken)
    with pytest.raises(RuntimeError, match="a sampler bug"):
        llm.generate(prompts(1, 7)[0], GREEDY)
    with pytest.raises(RuntimeError, match="a sampler bug"):
        list(session.generate(max_tokens=3))
    monkeypatch.setattr(llm.engine._sampler, "sample", sample)
    assert len(list(session.generate(max_tokens=3, ignore_eos=True))) == 3  # the session is intact
    assert session.info().history_tokens == 13
    assert len(llm.generate(prompts(1, 7)[0], GREEDY)[0].token_ids) == 12
    assert llm.engine.alive


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_dead_engine_loop_refuses_new_work_as_unavailable(tiny_llm, monkeypatch):
    llm = tiny_llm("llama")
    service = RuntimeService(llm, "tiny")

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the bug handler")

    monkeypatch.setattr(llm.engine._sampler, "sample", broken)
    monkeypatch.setattr(llm.engine, "_fail", broken)
    llm.create_session(prompts(1, 5)[0]).generate(max_tokens=2)  # its step fails, then so does the handler
    llm.engine._thread.join(timeout=30)
    assert not llm.engine.alive
    assert service.health()["status"] == "engine_failed"
    with pytest.raises(UnavailableError, match="internal error"):
        llm.generate(prompts(1, 5)[0], GREEDY)


def test_a_request_whose_sampling_fails_fails_alone(tiny_llm, monkeypatch):
    """Sampling that fails for one request of a batch (a bug) fails that request; the rest go on."""
    llm = tiny_llm("llama")
    sample = llm.engine._sampler.sample

    def fails_for_warm_requests(logits, params, request_ids):
        if any(p.temperature == 0.7 for p in params):
            raise RuntimeError("a sampler bug")
        return sample(logits, params, request_ids)

    monkeypatch.setattr(llm.engine._sampler, "sample", fails_for_warm_requests)
    session = llm.create_session(prompts(1, 9)[0])
    healthy = session.generate(max_tokens=300, ignore_eos=True)  # still running when the other fails
    with pytest.raises(RuntimeError, match="a sampler bug"):
        llm.generate(prompts(1, 7)[0], GREEDY, temperature=0.7)
    assert healthy.result().usage.generated_tokens == 300


def test_a_refused_prompt_refuses_the_whole_batch_before_any_runs(tiny_llm):
    llm = tiny_llm("llama")
    before = llm.engine.stats.generated_tokens
    with pytest.raises(InvalidArgumentError, match="empty"):
        llm.generate([prompts(1, 5)[0], []], GREEDY)
    with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
        llm.generate(prompts(1, 5)[0], GREEDY, stop_token_ids=(10**6,))
    assert llm.engine.stats.generated_tokens == before


def test_numpy_token_arrays_are_prompts_and_histories(tiny_llm):
    llm = tiny_llm("llama")
    prompt = prompts(1, 6)[0]
    expected = llm.generate(prompt, GREEDY)[0].token_ids
    assert llm.generate(np.array(prompt), GREEDY)[0].token_ids == expected
    assert [o.token_ids for o in llm.generate(np.array([prompt, prompt]), GREEDY)] == [expected, expected]
    session = llm.create_session(np.array(prompt[:3]))
    session.append(np.array(prompt[3:]))
    assert list(session.generate(GREEDY)) == expected
    with pytest.raises(InvalidArgumentError, match="fork position"):
        session.fork(at=True)


def test_competing_requests_that_each_fit_alone_all_complete(tiny_llm):
    """Four requests of 15 pages each in a 24-page pool: some are preempted and requeued, none fails, and
    each gives the tokens it gives alone."""
    llm = tiny_llm("llama", page_size=4, kv_pages=24)
    batch = prompts(4, 20)
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in batch]
    together = [o.token_ids for o in llm.generate(batch, params)]
    assert together == alone
    assert llm.engine.stats.preemptions > 0 and llm.engine.stats.kv_dropped_tokens["preempted"] > 0


def test_callbacks_run_without_the_engine_lock(tiny_llm):
    """Token and finish events are emitted with the engine lock released: another thread can take it
    while a callback runs (a slow consumer never stalls session calls)."""
    llm = tiny_llm("llama")
    engine = llm.engine
    acquired: list[bool] = []

    def emit(event):
        def try_lock():
            if engine._lock.acquire(timeout=2):
                engine._lock.release()
                acquired.append(True)
            else:
                acquired.append(False)

        other = threading.Thread(target=try_lock)
        other.start()
        other.join()

    request = engine.submit(engine.new_sequence(prompts(1, 6)[0], session=False), GREEDY, emit)
    deadline = time.monotonic() + 30
    while len(acquired) < 13 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert request.generated
    assert acquired == [True] * 13  # 12 tokens and the finish event


def test_shutdown_and_close_during_a_forward_wait_for_it(tiny_llm, monkeypatch):
    """Neither a session's close nor the engine's shutdown gives pages back while a forward that writes
    them is running; both complete once it ends, and everything is released."""
    llm = tiny_llm("llama", page_size=4)
    session = llm.create_session(prompts(1, 10)[0])
    session.generate(max_tokens=1).result()
    inside, proceed = threading.Event(), threading.Event()
    forward = llm.engine.model.forward

    def slow_forward(*args, **kwargs):
        inside.set()
        assert proceed.wait(30)
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.engine.model, "forward", slow_forward)
    stream = session.generate(max_tokens=50, ignore_eos=True)
    assert inside.wait(30)
    used = llm.engine.kv_usage().used
    session.close()  # cancels; the pages stay until the forward ends
    closer = threading.Thread(target=llm.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and llm.engine.kv_usage().used == used
    proceed.set()
    closer.join(30)
    assert not closer.is_alive()
    assert stream.result().finish_reason == "cancelled"
    assert llm.engine.kv_usage().used == 0


def test_requests_and_sequences_compare_by_identity(tiny_llm):
    llm = tiny_llm("llama")
    a = llm.engine.new_sequence([1, 2, 3], session=False)
    b = llm.engine.new_sequence([1, 2, 3], session=False)
    assert a != b and a == a
