"""Every accepted request ends with exactly one finish event, whatever a callback or the loop does, and
a dead engine loop fails every waiting and later caller with UnavailableError at once."""

from __future__ import annotations

import logging
import threading

import pytest

from kiln import SamplingParams
from kiln.engine.output import Outputs
from kiln.engine.sequence import FinishEvent, Request, TokenEvent
from kiln.engine.stats import EngineStats
from kiln.engine.stream import GenerationStream
from kiln.errors import UnavailableError
from kiln.results import GenerationResult
from tests.conftest import byte_tokenizer, outcome_within
from tests.engine.test_engine import prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WAIT_S = 30  # far beyond what any of these takes: reaching it means the caller would wait forever


def finish_of(stream: GenerationStream) -> GenerationResult | Exception:
    """The stream's result or the error it ended with; fails (instead of hanging the run) when the
    stream never gets its finish event."""
    return outcome_within(stream.result, WAIT_S, "the stream never got its finish event")  # type: ignore[return-value]


def break_the_loop(llm, monkeypatch, gate: threading.Event | None = None) -> None:
    """A step fails (once `gate` is set), and so does failing its requests (e.g. cache.drop raising):
    the loop cannot go on."""

    def broken(*args: object, **kwargs: object) -> None:
        if gate is not None:
            assert gate.wait(WAIT_S)
        raise RuntimeError("a bug in the step and in its error handler")

    monkeypatch.setattr(llm.engine._sampler, "sample", broken)
    monkeypatch.setattr(llm.engine, "_fail", broken)


def test_a_dying_loop_ends_running_and_queued_requests_with_unavailable(tiny_llm, monkeypatch):
    llm = tiny_llm("llama", max_num_seqs=1)  # the second request waits in the queue
    failures: list[BaseException] = []
    llm.engine.add_failure_observer(failures.append)
    both_submitted = threading.Event()
    break_the_loop(llm, monkeypatch, both_submitted)
    session = llm.create_session(prompts(1, 5)[0])
    running = session.generate(GREEDY)
    queued = llm.start(prompts(1, 7, seed=1)[0], GREEDY, GenerationStream(llm.engine.cancel))
    both_submitted.set()
    for stream in (running, queued):
        error = finish_of(stream)
        assert isinstance(error, UnavailableError) and "engine loop stopped" in str(error)
    assert not llm.engine.alive and isinstance(llm.engine.failure, RuntimeError)
    assert failures == [llm.engine.failure]
    assert not session.info().generating  # the session is free, not stuck "already has a generate in flight"
    late: list[BaseException] = []
    llm.engine.add_failure_observer(late.append)  # registered after the death: told at once
    assert late == [llm.engine.failure]


def test_a_dead_loop_refuses_every_later_call_at_once(tiny_llm, monkeypatch):
    llm = tiny_llm("llama")
    break_the_loop(llm, monkeypatch)
    session = llm.create_session(prompts(1, 5)[0])
    assert isinstance(finish_of(session.generate(GREEDY)), UnavailableError)
    with pytest.raises(UnavailableError):
        session.generate(GREEDY)
    with pytest.raises(UnavailableError):
        llm.generate(prompts(1, 5)[0], GREEDY)
    with pytest.raises(UnavailableError):
        session.fork()
    with pytest.raises(UnavailableError):
        session.append([5, 6])
    assert llm.engine.pending() == 0
    session.close()  # closing needs no loop: it never touches the pool again
    llm.close()


def test_a_raising_finish_callback_never_keeps_the_others_from_theirs(tiny_llm, caplog):
    """Two requests that end in the same step: the first one's callback raises on its finish event."""
    engine = tiny_llm("llama").engine
    received: list[object] = []

    def raising(event: object) -> None:
        if isinstance(event, FinishEvent):
            raise RuntimeError("a consumer bug")

    done = threading.Event()

    def recording(event: object) -> None:
        received.append(event)
        if isinstance(event, FinishEvent):
            done.set()

    prompt = prompts(1, 6)[0]
    with caplog.at_level(logging.ERROR, logger="kiln.engine.output"):
        engine.submit(engine.new_sequence(prompt, session=False), GREEDY, raising)
        engine.submit(engine.new_sequence(prompt, session=False), GREEDY, recording)
        assert done.wait(WAIT_S), "the second request never got its finish event"
    assert received[-1].reason == "length" and sum(isinstance(e, TokenEvent) for e in received) == 6
    assert "callback" in caplog.text and engine.alive


def test_a_raising_token_callback_cancels_its_request_alone(tiny_llm):
    llm = tiny_llm("llama")
    engine = llm.engine
    ends: list[FinishEvent] = []

    def raising(event: object) -> None:
        if isinstance(event, FinishEvent):
            ends.append(event)
        else:
            raise RuntimeError("a consumer bug")

    engine.submit(engine.new_sequence(prompts(1, 6)[0], session=False), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True), raising)
    healthy = llm.generate(prompts(1, 6, seed=1)[0], GREEDY)[0]
    assert healthy.finish_reason == "length" and len(healthy.token_ids) == 6
    llm.close()  # every request has ended by now
    assert [end.reason for end in ends] == ["cancelled"]


def test_a_raising_finish_observer_is_logged_and_every_caller_still_gets_its_finish(tiny_llm, caplog):
    llm = tiny_llm("llama")

    def observer(request: Request, reason: str) -> None:
        raise RuntimeError("a metrics bug")

    llm.engine.add_finish_observer(observer)
    with caplog.at_level(logging.ERROR, logger="kiln.engine.output"):
        streams = [llm.start(p, GREEDY, GenerationStream(llm.engine.cancel)) for p in prompts(3, 5)]
        results = [finish_of(stream) for stream in streams]
    assert [r.finish_reason for r in results] == ["length"] * 3  # type: ignore[union-attr]
    assert "finish observer raised" in caplog.text and llm.engine.alive


def test_a_request_gets_one_finish_event_however_many_endings_are_delivered():
    outputs = Outputs(byte_tokenizer(), 64, EngineStats())
    events: list[object] = []
    request = Request(None, GREEDY, events.append, frozenset())  # type: ignore[arg-type]
    outputs.track(request)
    usage = request.usage()
    outputs.deliver([(request, FinishEvent("stop", usage)), (request, FinishEvent("cancelled", usage))])
    assert outputs.fail_open(UnavailableError("gone")) == 0
    assert [event.reason for event in events] == ["stop"]  # type: ignore[attr-defined]


def test_a_dead_loop_still_captures_a_history_without_its_suspect_kv(tiny_llm, monkeypatch):
    llm = tiny_llm("llama")
    engine = llm.engine
    break_the_loop(llm, monkeypatch)
    seq = engine.new_sequence(prompts(1, 20)[0], session=True)
    stream = GenerationStream(engine.cancel)
    stream.request = engine.submit(seq, GREEDY, stream.emit)
    assert isinstance(finish_of(stream), UnavailableError)
    image = engine.capture_sequence(seq, {})
    assert image.tokens == seq.tokens and image.num_computed == 0 and not image.blocks
    assert all(not pages for pages in image.pages)
