"""Speculative decoding (kiln/engine/speculative.py): n-gram drafts from the history; greedy output equal
to decoding one token at a time whatever is accepted (every rejection position, page boundaries, sessions,
shared prefix pages, batches); rejected K/V rolled back; the sampling distribution preserved; counters;
bad options refused."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import MAX_DRAFTING_SEQUENCES
from kiln.engine.speculative import MAX_COOLDOWN, NgramIndex, NgramProposer, verify
from kiln.errors import InvalidArgumentError
from kiln.llm import LLM

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def repetitive(seed: int, length: int = 40) -> list[int]:
    """A prompt that repeats a random phrase, so n-gram drafts exist from the first decode step."""
    phrase = torch.randint(3, 200, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
    return (phrase * (length // 7 + 1))[:length]


def pages_in_use_settle_to_zero(llm) -> bool:
    """Finished stateless requests give their pages back at the engine's next step: wait for it."""
    deadline = time.monotonic() + 10
    while llm.engine.kv_usage().used and time.monotonic() < deadline:
        time.sleep(0.01)
    return llm.engine.kv_usage().used == 0


def sequence_of(session):
    return session.llm.sessions._sessions[session.id].seq


def test_index_drafts_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 5, 2, 3]
    assert index.draft(tokens, 3) == [8, 5, 2]  # "2 3" last occurred at 5-6, followed by 8 5 2
    tokens.append(8)
    assert index.draft(tokens, 2) == [5, 2]  # "2 3 8" (the longest match) at 5-7, followed by 5 2
    assert index.draft([4, 5, 6, 7], 4) == []  # nothing recurs (the index never sees other lists' tokens)
    assert NgramIndex().draft([1, 1], 4) == []  # one repeated token is not a match


def test_proposer_backs_off_after_misses_and_resumes_on_acceptance(tiny_llm) -> None:
    llm = tiny_llm("llama")
    request = llm.engine.submit(llm.engine.new_sequence(repetitive(0), session=False), GREEDY, lambda event: None)
    proposer = NgramProposer(4)
    assert len(proposer.propose(request, 8)) == 4
    waits = []
    for _ in range(8):
        proposer.feedback(request, 4, 0)
        skipped = 0
        while not proposer.propose(request, 8):
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 8, 16, 32, MAX_COOLDOWN, MAX_COOLDOWN]
    proposer.feedback(request, 4, 1)
    assert proposer.propose(request, 8)  # an acceptance resets the pause
    llm.engine.cancel(request)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3"])
def test_greedy_output_equals_plain_decoding(tiny_llm, arch: str) -> None:
    """Page size 4 < draft + 1 rows, so drafts cross page boundaries; prompts of several shapes, as many
    as decode together while drafting."""
    plain = tiny_llm(arch, speculative=None, page_size=4)
    spec = tiny_llm(arch, page_size=4, num_speculative_tokens=5)
    prompts = [repetitive(seed, 9 + 11 * seed) for seed in range(MAX_DRAFTING_SEQUENCES)]
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    stats = spec.engine.stats
    assert stats.spec_accepted_tokens > 0  # the drafts were used, not just proposed
    assert pages_in_use_settle_to_zero(spec)  # rolled-back and finished pages all came back


@pytest.mark.parametrize("wrong_at", range(5))
def test_rejection_at_every_position_rolls_back(tiny_llm, monkeypatch: pytest.MonkeyPatch, wrong_at: int) -> None:
    """Drafts are the true greedy continuation with the token at `wrong_at` altered, so exactly
    `wrong_at` draft tokens are accepted each time; the output must not change."""
    prompt = repetitive(5, 13)
    expected = tiny_llm("gemma3", speculative=None, page_size=4).generate(prompt, GREEDY)[0].token_ids
    truth = prompt + expected
    acceptable: list[int] = []  # per draft, how many of its tokens are right

    def oracle(self, request, limit):
        start = len(request.seq.tokens)
        draft = truth[start : start + min(limit, self.num_tokens)]
        if len(draft) > wrong_at:
            draft[wrong_at] = (draft[wrong_at] + 1) % 256
        if draft:
            acceptable.append(min(wrong_at, len(draft)))
        return draft

    monkeypatch.setattr(NgramProposer, "propose", oracle)
    spec = tiny_llm("gemma3", page_size=4, num_speculative_tokens=5)
    session = spec.create_session(prompt)
    assert session.generate(GREEDY).result().token_ids == expected
    stats = spec.engine.stats
    assert stats.spec_verify_steps == len(acceptable) > 0
    assert stats.spec_accepted_tokens == sum(acceptable)
    spec.engine.check_sequence(sequence_of(session))  # INV-1: pages agree with the tokens after the rollbacks
    assert session.info().computed_tokens == len(session.tokens) - 1


def test_sessions_and_shared_prefix_pages(tiny_llm) -> None:
    """Two sessions share a prompt's pages (prefix cache) and run several turns side by side; drafts are
    written and rolled back beside shared pages, and every turn equals plain decoding."""
    outputs = {}
    for name, options in {"plain": {"speculative": None}, "spec": {}}.items():
        llm = tiny_llm("llama", page_size=4, **options)
        first, second = llm.create_session(repetitive(1, 24)), llm.create_session(repetitive(1, 24))
        turns = []
        for turn in range(3):
            for session in (first, second):
                session.append(repetitive(10 + turn, 6))
            turns += [f.result().token_ids for f in [first.generate(GREEDY), second.generate(GREEDY)]]
        outputs[name] = turns
        for session in (first, second):
            llm.engine.check_sequence(sequence_of(session))
    assert outputs["spec"] == outputs["plain"]


def test_drafts_under_memory_pressure_match_plain_decoding(tiny_llm) -> None:
    """A pool too small for all requests at once: requests are preempted and resumed while drafts come
    and go; drafts never cause a preemption, and every output equals plain decoding."""
    prompts = [repetitive(seed, 20) for seed in range(6)]
    outputs, pressure = {}, {}
    for name, options in {"plain": {"speculative": None}, "spec": {}}.items():
        llm = tiny_llm("llama", kv_pages=16, page_size=4, **options)
        outputs[name] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        pressure[name] = llm.engine.stats.preemptions + sum(llm.engine.stats.kv_dropped_tokens.values())
        assert pages_in_use_settle_to_zero(llm)
    assert outputs["spec"] == outputs["plain"]
    # Each request grows to 11 of the 16 pages (one group, no window): three start together and must
    # make room as they grow; how often depends on how arrivals interleave with steps.
    assert pressure["plain"] + pressure["spec"] > 0


def test_max_tokens_and_stop_tokens_inside_a_draft(tiny_llm) -> None:
    plain = tiny_llm("gemma3", speculative=None)
    spec = tiny_llm("gemma3")
    prompt = repetitive(2)
    full = plain.generate(prompt, GREEDY)[0].token_ids
    for max_tokens in (1, 2, 3, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert spec.generate(prompt, params)[0].token_ids == full[:max_tokens]
    stop = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(full[5],), ignore_eos=True)
    out = spec.generate(prompt, stop)[0]
    assert out.token_ids == full[: full.index(full[5]) + 1] and out.finish_reason == "stop"


def test_verify_keeps_the_sampling_distribution() -> None:
    """Rejection sampling with a point-mass draft: the first two output tokens are distributed as the
    rows' own distributions (chi-square against the exact probabilities, 8 tokens, 6000 trials), whether
    the draft is the likeliest token, a plausible one, or one the distribution rules out."""
    probs = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02, 0.0], [0.05, 0.05, 0.3, 0.3, 0.1, 0.1, 0.05, 0.05], [0.125] * 8])
    logits = probs.clamp(min=1e-30).log()
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=11)  # one seeded stream: a fixed outcome, not a 0.6 % flake
    sampler = Sampler()
    trials = 6000
    for draft in ([0, 2], [3, 3], [7, 1]):
        first, second = Counter(), Counter()
        for _ in range(trials):
            out = verify(logits, draft, params, sampler, request_id=1)
            first[out[0]] += 1
            if out[0] == draft[0]:
                second[out[1]] += 1
        for counts, row in ((first, probs[0]), (second, probs[1])):
            n = sum(counts.values())
            expected = row * n
            support = expected > 0
            chi2 = sum((counts[t] - float(expected[t])) ** 2 / float(expected[t]) for t in range(8) if support[t])
            assert all(counts[t] == 0 for t in range(8) if not support[t])
            assert chi2 < 24.3, (draft, counts, chi2)  # p = 0.001 at 7 degrees of freedom


def test_seeded_sampling_with_drafts_is_reproducible(tiny_llm) -> None:
    llm = tiny_llm("gemma3")
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=7, ignore_eos=True)
    runs = [llm.generate(repetitive(3), params)[0].token_ids for _ in range(2)]
    assert runs[0] == runs[1] and llm.engine.stats.spec_verify_steps > 0


def test_metrics_export_the_counters(tiny_llm) -> None:
    from kiln.server.metrics import Metrics

    llm = tiny_llm("gemma3")
    llm.generate(repetitive(4), GREEDY)
    text = Metrics(llm).render().decode()
    stats = llm.engine.stats
    assert f"kiln_spec_accepted_tokens_total {float(stats.spec_accepted_tokens)}" in text
    assert f"kiln_spec_proposed_tokens_total {float(stats.spec_proposed_tokens)}" in text
    assert f"kiln_spec_verify_steps_total {float(stats.spec_verify_steps)}" in text
    assert stats.spec_accepted_tokens > 0


def test_cli_flags_mirror_the_config() -> None:
    import argparse

    from kiln import cli

    parser = argparse.ArgumentParser()
    cli._engine_args(parser)
    options = cli.engine_options(parser.parse_args(["--speculative", "none", "--num-speculative-tokens", "6"]))
    assert options["speculative"] is None and options["num_speculative_tokens"] == 6
    assert "speculative" not in cli.engine_options(parser.parse_args([]))  # unset: the config's default (ngram)


def test_bad_options_are_refused_at_start() -> None:
    with pytest.raises(InvalidArgumentError, match=r"speculative must be one of \['ngram'\] or None, got 'eagle'"):
        EngineConfig(speculative="eagle")
    for bad in (0, 17, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="num_speculative_tokens must be an integer in"):
            EngineConfig(num_speculative_tokens=bad)
    with pytest.raises(InvalidArgumentError, match="speculative must be"):
        LLM("/nonexistent/model.gguf", speculative="medusa")  # refused before the (missing) model loads


@pytest.mark.parametrize("pattern", [r"(ab|cd)+", r"[a-d]{3}(-[a-d]{3})*"])
def test_constrained_drafts_are_checked_against_the_grammar(tiny_llm, pattern: str) -> None:
    """Drafts from a history full of the grammar's own text: greedy output equals plain decoding under
    the same constraint and drafts were verified (a token the matcher refused would have failed the
    request: every token was accepted once, after verification rolled its own advances back)."""
    import re

    prompt = list(b"abcdabcd-abc-abd-" * 4)
    params = {"max_tokens": 30, "temperature": 0.0, "regex": pattern, "ignore_eos": True}
    plain = tiny_llm("llama", speculative=None).generate(prompt, **params)[0]
    spec_llm = tiny_llm("llama")
    spec = spec_llm.generate(prompt, **params)[0]
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == 30
    assert re.fullmatch(r"[a-d-]+", spec.text)  # the grammar's alphabet only (plain decoding's tests check the rest)
    assert spec_llm.engine.stats.spec_verify_steps > 0 and spec.finish_reason == "length"
