"""Repetition, presence and frequency penalties and min-p (kiln/engine/penalties.py, sampler.py): the
peers' semantics against HF transformers' processors and OpenAI's formula, end to end against HF's
model with its processor; greedy output identical with and without speculation (drafts rejected at every
position); batch invariance, bit-identical in deterministic mode; with a grammar; out-of-range values refused."""

from __future__ import annotations

import pytest
import torch
from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

from kiln import SamplingParams
from kiln.engine.penalties import Penalties
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledChunk
from kiln.engine.sequence import Request, Sequence
from kiln.engine.speculative import NgramProposer
from kiln.engine.step_sampler import StepSampler
from kiln.engine.stream import GenerationStream
from kiln.errors import InvalidArgumentError
from tests.tiny_models import tiny_hf_model

VOCAB = 256
PENALTIES = [
    {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.6},
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"frequency_penalty": -0.7, "presence_penalty": 0.9, "repetition_penalty": 1.3},
]


def counted(tokens: list[int], generated: list[int]) -> Penalties:
    penalties = Penalties.empty(VOCAB, torch.device("cpu"))
    penalties.sync(tokens, generated)
    return penalties


def penalised(penalties: Penalties, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    penalties.apply_(out, params)
    return out


def openai_reference(logits: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's rule, token by token: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for token in set(generated):
        count = generated.count(token)
        out[token] = logits[token] - count * frequency - float(count > 0) * presence
    return out


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    history = [5, 9, 9, 200, 31, 5, 77]
    for penalty in (0.5, 1.0, 1.3, 7.0):
        expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[None].clone())[0]
        got = penalised(counted(history, history[4:]), logits, SamplingParams(repetition_penalty=penalty))
        assert torch.equal(got, expected)


def test_presence_and_frequency_follow_openai_over_the_reply_only() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1))
    prompt, reply = [3, 4, 4, 8], [4, 8, 8, 8, 100]
    params = SamplingParams(presence_penalty=0.75, frequency_penalty=-0.5)
    got = penalised(counted(prompt + reply, reply), logits, params)
    assert torch.allclose(got, openai_reference(logits, reply, 0.75, -0.5), atol=1e-6)
    assert got[3] == logits[3]  # in the prompt only: untouched


def test_min_p_keeps_what_transformers_keeps() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    for min_p, temperature in ((0.05, 1.0), (0.3, 0.7), (1.0, 1.0)):
        probs = Sampler().probabilities(logits, SamplingParams(temperature=temperature, min_p=min_p))
        kept = MinPLogitsWarper(min_p)(None, (logits / temperature)[None])[0] > float("-inf")
        assert torch.equal(probs > 0, kept)


def test_draft_rows_count_the_draft_tokens_before_them() -> None:
    """Row i of a draft is what one-token-at-a-time decoding would penalise after draft[:i]."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    history, reply, draft = [1, 2, 3], [3, 7], [11, 7, 9, 11, 7]  # 11 and 9 new, 11 first: not in sorted order
    params = SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25)
    rows = logits.repeat(len(draft) + 1, 1)
    counted(history + reply, reply).apply_draft_(rows, draft, params)
    for i in range(len(draft) + 1):
        alone = penalised(counted(history + reply + draft[:i], reply + draft[:i]), logits, params)
        assert torch.equal(rows[i], alone)


def test_the_steps_logits_are_never_written() -> None:
    """Penalties write in place into a copy: the step's logits stay as the model gave them (a batch whose
    sampling fails is sampled again row by row from them), for plain rows and a draft's alike."""
    params = SamplingParams(repetition_penalty=50.0, frequency_penalty=2.0)
    request = Request(Sequence([4, 5, 4], table=None), params, emit=lambda event: None, stop_token_ids=frozenset(),
                      generated=[4])
    logits = torch.zeros(4, VOCAB)  # the plain chunk's row, then the draft chunk's three
    logits[:, 4] = 10.0  # the likeliest token, until penalised
    before = logits.clone()
    plain, drafted = StepSampler(Sampler()).sample([ScheduledChunk(request, 1), ScheduledChunk(request, 3, draft=[9, 9])],
                                                   logits)
    assert torch.equal(logits, before)
    assert plain[0][0] != 4 and drafted[0][0] != 4


@pytest.mark.parametrize("options", [{"repetition_penalty": 1.6}, {"presence_penalty": 1.2, "frequency_penalty": 0.8}])
def test_greedy_generation_matches_transformers_with_its_processor(tiny_llm, options: dict[str, float]) -> None:
    """End to end: each step HF's model, its repetition-penalty processor (OpenAI's rule for the other
    two), argmax; against Kiln's exact path."""
    llm = tiny_llm("llama", quantization=None, speculative=None)
    model = tiny_hf_model("llama")
    prompt = [5, 17, 17, 40, 5, 99, 17]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            if "repetition_penalty" in options:
                logits = RepetitionPenaltyLogitsProcessor(options["repetition_penalty"])(torch.tensor([ids]), logits[None])[0]
            else:
                logits = openai_reference(logits, ids[len(prompt):], options["presence_penalty"], options["frequency_penalty"])
            ids.append(int(logits.argmax()))
    params = SamplingParams(max_tokens=12, ignore_eos=True, **options)
    assert llm.generate(prompt, params)[0].token_ids == ids[len(prompt):]
    assert llm.generate(prompt, max_tokens=12, ignore_eos=True)[0].token_ids != ids[len(prompt):]  # it mattered


@pytest.mark.parametrize("options", PENALTIES)
def test_greedy_output_is_the_same_with_speculation(tiny_llm, monkeypatch: pytest.MonkeyPatch, options) -> None:
    """Drafts are the true penalised greedy continuation with the token at `wrong_at` altered, so each
    verification accepts `wrong_at` draft tokens: the rows after them must count them, or the output
    changes (unpenalised, this model soon repeats one token, so a row that missed the draft tokens before
    it would pick that token again). The n-gram proposer's own drafts must not change it either."""
    params = SamplingParams(max_tokens=16, ignore_eos=True, **options)
    prompt = [34, 155, 11, 178, 80, 161, 46, 240]
    expected = tiny_llm("llama", speculative=None, page_size=4).generate(prompt, params)[0].token_ids
    spec = tiny_llm("llama", page_size=4, num_speculative_tokens=5)
    assert spec.generate(prompt, params)[0].token_ids == expected
    truth = prompt + expected
    wrong_at = 0

    def oracle(self, request, limit):
        start = len(request.seq.tokens)
        draft = truth[start : start + min(limit, self.num_tokens)]
        if len(draft) > wrong_at:
            draft[wrong_at] = (draft[wrong_at] + 1) % VOCAB
        return draft

    monkeypatch.setattr(NgramProposer, "propose", oracle)
    for wrong_at in (1, 3, 5):
        accepted = spec.engine.stats.spec_accepted_tokens
        assert spec.create_session(prompt).generate(params).result().token_ids == expected, f"wrong at {wrong_at}"
        assert spec.engine.stats.spec_accepted_tokens > accepted


@pytest.mark.parametrize("deterministic", [False, True])
def test_batch_invariant(tiny_llm, deterministic: bool) -> None:
    """A penalised request's tokens (and, deterministic, its logprobs' bits) do not depend on its
    batch-mates: alone, or beside requests with other penalties, none, or sampling."""
    llm = tiny_llm("qwen3", deterministic=deterministic, speculative=None)
    prompt = [7, 8, 9, 7, 8, 9, 7]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True, repetition_penalty=1.5, presence_penalty=0.4,
                            frequency_penalty=0.3, min_p=0.1)
    alone = llm.generate(prompt, params)[0]
    mates = [SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=-1.0),
             SamplingParams(max_tokens=5, temperature=0.8, seed=3, min_p=0.2, repetition_penalty=2.0), None]
    streams = [llm.start(tokens, mate or params, GenerationStream(llm.engine.cancel)) for tokens, mate in
               zip([[1, 2, 3, 4], [9, 9, 9], prompt], mates, strict=True)]
    together = streams[2].result()
    assert together.token_ids == alone.token_ids
    if deterministic:
        assert together.logprobs == alone.logprobs
    else:
        assert together.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_penalties_under_a_grammar_only_pick_allowed_tokens(tiny_llm) -> None:
    """A strong penalty never lets a token the grammar refuses through (-inf stays -inf), and the text
    stays a match."""
    llm = tiny_llm("llama")
    out = llm.generate([5, 6, 7], max_tokens=12, regex="(ab|ba)+c", repetition_penalty=50.0, frequency_penalty=2.0,
                       presence_penalty=2.0)[0]
    assert out.text.startswith(("ab", "ba")) and set(out.text) <= set("abc")


@pytest.mark.parametrize(("options", "field"), [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 101.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
])
def test_out_of_range_values_are_refused_naming_the_field(options: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as caught:
        SamplingParams(**options)
    assert caught.value.param == field


def test_neutral_values_are_not_penalised() -> None:
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0).penalised
    assert SamplingParams(frequency_penalty=-2.0).penalised
