"""Async scheduling (kiln/engine/run_ahead.py): decode steps launched from their predecessor's ids before those
reach the host. On the CPU nothing overlaps, but every decision and every rollback is the same as on a GPU: the
tokens, finish reasons, histories and pages must be what the synchronous engine gives."""

from __future__ import annotations

import logging

import pytest

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.engine import Engine
from kiln.engine.stream import GenerationStream
from kiln.errors import InvalidArgumentError
from tests.models.test_parity import random_tokens

PROMPTS = [random_tokens(n, seed=n) for n in (9, 21, 14)]


@pytest.fixture(autouse=True)
def no_failed_steps(caplog):
    """A step that raises fails only the requests in flight, which may be none: the log is where it shows."""
    yield
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("kiln.engine")]


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Sizes of the decode steps launched ahead."""
    seen: list[int] = []
    original = Engine._run_ahead

    def counting(self, launched):
        ahead = original(self, launched)
        if ahead is not None:
            seen.append(len(ahead.chunks))
        return ahead

    monkeypatch.setattr(Engine, "_run_ahead", counting)
    return seen


def engines(tiny_llm, arch: str = "llama", **options):
    sync = tiny_llm(arch, speculative=None, decode_graphs=True, async_scheduling=False, **options)
    ahead = tiny_llm(arch, speculative=None, decode_graphs=True, async_scheduling=True, **options)
    return sync, ahead


def sequence_of(session):
    return session.llm.sessions._sessions[session.id].seq


def test_config_needs_decode_graphs_and_defaults_to_the_gpu() -> None:
    with pytest.raises(InvalidArgumentError, match="async_scheduling"):
        EngineConfig(decode_graphs=False, async_scheduling=True)
    assert EngineConfig(decode_graphs=True).async_scheduling is False  # the CPU captures nothing


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_generation_runs_ahead_and_gives_the_synchronous_tokens(tiny_llm, launches, arch: str) -> None:
    sync, ahead = engines(tiny_llm, arch)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = sync.generate(PROMPTS, params)
    assert not launches
    got = ahead.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.finish_reason for r in got] == ["length"] * 3
    assert launches and max(launches) == 3
    stats = ahead.engine.stats
    assert stats.ahead_steps == len(launches) and stats.static_decode_steps > stats.ahead_steps
    assert sync.engine.stats.ahead_steps == 0 and sync.engine.stats.static_decode_steps > 0


def test_a_stop_token_or_string_mid_run_rolls_the_row_launched_ahead_back(tiny_llm, launches) -> None:
    sync, ahead = engines(tiny_llm)
    reference = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    stop_id = reference[5]
    stop_text = sync.tokenizer.decode(reference[7:9])
    for params in (SamplingParams(max_tokens=16, stop_token_ids=(stop_id,), ignore_eos=True),
                   SamplingParams(max_tokens=16, stop=(stop_text,), ignore_eos=True)):
        expected = sync.start(PROMPTS[1], params, _stream(sync)).result()
        got = ahead.start(PROMPTS[1], params, _stream(ahead)).result()
        assert (got.token_ids, got.finish_reason, got.stop_string) == (expected.token_ids, "stop", expected.stop_string)
        assert len(got.token_ids) < 16
    assert launches


def test_a_session_keeps_the_synchronous_history_and_pages_across_turns(tiny_llm, launches) -> None:
    sync, ahead = engines(tiny_llm)
    reference = sync.generate([PROMPTS[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    histories = []
    for llm in (sync, ahead):
        session = llm.create_session()
        session.append(PROMPTS[0])
        for turn in range(3):
            params = SamplingParams(max_tokens=10, stop_token_ids=(reference[4],), ignore_eos=True)
            session.generate(params).result()
            session.append(random_tokens(5, seed=turn))
        seq = sequence_of(session)
        llm.engine.check_sequence(seq)  # the pages agree with the tokens: no K/V past the history was kept
        assert seq.num_computed < len(seq.tokens)
        histories.append(list(seq.tokens))
    assert histories[0] == histories[1]
    assert launches


def test_a_request_arriving_mid_run_is_admitted_and_sampling_requests_stay_synchronous(tiny_llm, launches) -> None:
    sync, ahead = engines(tiny_llm, max_num_seqs=4)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    results = {}
    for name, llm in (("sync", sync), ("ahead", ahead)):
        first = llm.start(PROMPTS[0], greedy, _stream(llm))
        for _ in range(5):  # the first request decodes on its own for a while
            next(iter(first))
        second = llm.start(PROMPTS[1], greedy, _stream(llm))
        results[name] = (first.result().token_ids, second.result().token_ids)
    assert results["ahead"] == results["sync"]
    launches.clear()
    sampled = ahead.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True))
    assert all(len(r.token_ids) == 8 for r in sampled)
    assert not launches  # a sampling request's tokens come from the host's sampler, one step at a time


def _stream(llm) -> GenerationStream:
    return GenerationStream(llm.engine.cancel)


def test_greedy_rows_with_logprobs_and_a_logit_bias_run_ahead_with_the_same_results(tiny_llm, launches) -> None:
    sync, ahead = engines(tiny_llm)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=3, logit_bias={5: 4.0, 7: -100.0})
    expected = [sync.start(p, params, _stream(sync)).result() for p in PROMPTS[:2]]
    got = [ahead.start(p, params, _stream(ahead)).result() for p in PROMPTS[:2]]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.token_ids == theirs.token_ids and 7 not in mine.token_ids
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-6)
        assert [[t for t, _ in top] for top in mine.top_logprobs] == [[t for t, _ in top] for top in theirs.top_logprobs]
    assert launches


class _Device:
    """What the step sampler asks of a GPU's platform."""

    on_host = False

    @staticmethod
    def of(device: object) -> type[_Device]:
        return _Device


def test_where_the_device_samples_seeded_sampling_runs_ahead_and_draws_what_the_synchronous_engine_does(
    tiny_llm, launches, monkeypatch
) -> None:
    """A GPU's steps sample on the device (BatchSampler), synchronous or ahead; simulated on the CPU by telling
    the step sampler and the engine the logits are not on the host."""
    monkeypatch.setattr("kiln.engine.step_sampler.Platform", _Device)
    sync, ahead = engines(tiny_llm)
    ahead.engine._on_host = False
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    expected = sync.generate(PROMPTS, params)
    assert not launches
    got = ahead.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert launches and max(launches) == 3


def test_a_shutdown_while_a_step_runs_ahead_leaves_pages_that_agree_with_the_history(tiny_llm, monkeypatch) -> None:
    """Shutdown arriving while a step launched ahead is in flight: its rows' K/V was never committed, so the
    requests it cancels give those pages back, and a session's turn ends checked and clean."""
    llm = tiny_llm("llama", speculative=None, decode_graphs=True, async_scheduling=True)
    original = Engine._run_ahead

    def stopping(self, launched):
        ahead = original(self, launched)
        seq = launched.chunks[0].request.seq
        if ahead is not None and seq.num_computed % llm.config.page_size == 0:  # its row took a page of its own
            self._stopping = True  # the loop ends after this step, the step launched ahead still pending
        return ahead

    monkeypatch.setattr(Engine, "_run_ahead", stopping)
    session = llm.create_session()
    session.append(PROMPTS[0])
    stream = session.generate(SamplingParams(max_tokens=50, ignore_eos=True))
    llm.engine._thread.join(timeout=60)
    assert llm.engine._ahead is not None
    llm.engine.shutdown()
    assert stream.result().finish_reason == "cancelled"  # not "error": the turn's end found the pages in order
    seq = sequence_of(session)
    llm.engine._cache.check(seq.table, seq.tokens, seq.num_computed)
