"""The batched sampler (kiln/engine/batch_sampler.py), run on CPU tensors: the host Sampler's semantics
(greedy is argmax; each cut leaves `Sampler.probabilities`' support, and draws follow its distribution),
seeded rows independent of their batch, logprobs of the model's distribution; through StepSampler with
the device path forced, logit bias, grammar masks and penalties as on the host; and on the meta device,
whose values cannot be read at all, the step reads the device only through its one `to_host`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln import SamplingParams
from kiln.engine import batch_sampler
from kiln.engine.batch_sampler import BatchSampler, Cuts, draw, probabilities
from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledChunk
from kiln.engine.sequence import Request, Sequence
from kiln.engine.step_sampler import StepSampler
from kiln.platform import Platform

VOCAB = 64
CUTS = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.6},
    {"temperature": 0.9, "top_p": 0.01},  # only the likeliest survives
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 2.0, "top_k": 12, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 1000},  # more than the vocabulary: no cut
]


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def request(params: SamplingParams, tokens: tuple[int, ...] = (1, 2, 3),
            generated: tuple[int, ...] = ()) -> Request:
    return Request(Sequence(list(tokens), table=None), params, emit=lambda event: None,
                   stop_token_ids=frozenset(), generated=list(generated))


class AllowOnly:
    """A grammar stand-in: its mask allows `tokens` only (constrain asks nothing else of a matcher)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill_mask(self, out: np.ndarray) -> None:
        out[:] = 0
        for token in self.tokens:
            out.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))


@pytest.fixture
def device_path(monkeypatch):
    """Every platform reports its tensors off the host: CPU tensors take the path a GPU's take."""
    monkeypatch.setattr(Platform, "on_host", property(lambda self: False))


def test_greedy_rows_are_the_argmax():
    logits = random_logits(5)
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1e-6), SamplingParams(temperature=1.5, top_p=0.5)]
    tokens = [token for token, _, _ in BatchSampler(Sampler()).sample(logits, params, list(range(5)))]
    for row in (0, 2, 3):
        assert tokens[row] == int(logits[row].argmax())


@pytest.mark.parametrize("options", CUTS)
def test_each_cut_leaves_the_host_samplers_distribution(options):
    logits = random_logits(4, seed=1)
    params = SamplingParams(**options)
    got = probabilities(logits, Cuts.of([params] * 4, VOCAB, logits.device))
    for row in range(4):
        expected = Sampler().probabilities(logits[row], params)
        assert torch.equal(got[row] > 0, expected > 0)
        torch.testing.assert_close(got[row], expected)


def test_mixed_cuts_in_one_batch_are_each_rows_own():
    logits = random_logits(len(CUTS), seed=2)
    params = [SamplingParams(**options) for options in CUTS]
    got = probabilities(logits, Cuts.of(params, VOCAB, logits.device))
    for row, p in enumerate(params):
        assert torch.equal(got[row] > 0, Sampler().probabilities(logits[row], p) > 0)


@pytest.mark.parametrize("options", CUTS)
def test_draws_follow_the_distribution(options):
    """20,000 draws of an 8-token vocabulary: every one inside the support, and each token's frequency
    within five standard errors of its probability."""
    torch.manual_seed(0)
    vocab, draws = 8, 20_000
    logits = random_logits(1, vocab, seed=3)
    params = SamplingParams(**options)
    expected = Sampler().probabilities(logits[0], params)
    expected = expected / expected.sum()
    probs = probabilities(logits.expand(draws, vocab), Cuts.of([params] * draws, vocab, logits.device))
    counts = torch.bincount(draw(probs, [None] * draws), minlength=vocab).double()
    assert torch.all(counts[expected == 0] == 0)
    error = 5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-9
    assert torch.all((counts / draws - expected).abs() <= error), (counts / draws, expected)


def test_a_seeded_row_does_not_depend_on_its_batch():
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.8), SamplingParams(), SamplingParams(temperature=1.2, seed=7)]

    def tokens(batch: list[int]) -> list[int]:
        """Three steps of the seeded request (id 0) in a batch of `others` (ids 1, 2, 3) in `batch` order."""
        sampler, drawn = BatchSampler(Sampler()), []
        for step in range(3):
            logits = random_logits(len(batch), seed=10 + step)
            row = batch.index(0)
            logits[row] = random_logits(1, seed=100 + step)[0]  # the seeded request's row, whatever the batch
            params = [seeded if i == 0 else others[i - 1] for i in batch]
            drawn.append(sampler.sample(logits, params, batch)[row][0])
        return drawn

    alone = tokens([0])
    assert tokens([1, 0, 2]) == alone and tokens([3, 2, 1, 0]) == alone and tokens([0, 3]) == alone
    assert len({tuple(tokens([0])) for _ in range(3)}) == 1


def test_logprobs_and_top_logprobs_are_the_models_distribution():
    logits = random_logits(3, seed=4)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=True, top_logprobs=4),
              SamplingParams(logprobs=True), SamplingParams(temperature=1.0, top_logprobs=2)]
    sampled = BatchSampler(Sampler()).sample(logits, params, [0, 1, 2])
    expected = torch.log_softmax(logits, dim=-1)
    for row, (token, logprob, tops) in enumerate(sampled):
        k = params[row].top_logprobs
        assert logprob == (float(expected[row, token]) if params[row].logprobs else None)
        values, ids = expected[row].topk(k)
        assert tops == (tuple(zip(ids.tolist(), values.tolist(), strict=True)) if k else None)


def test_greedy_requests_match_the_host_path_with_bias_penalties_and_grammar(monkeypatch):
    """The same greedy requests through StepSampler on the host and on the device path: the same tokens,
    logprobs and alternatives (bias, penalties and masks change the logits identically)."""
    make = [
        lambda: request(SamplingParams(logprobs=True, top_logprobs=3)),
        lambda: request(SamplingParams(logit_bias=((9, 60.0), (10, -5.0)), logprobs=True)),
        lambda: request(SamplingParams(repetition_penalty=50.0, frequency_penalty=2.0, presence_penalty=1.0,
                                       top_logprobs=2), tokens=(4, 5, 4), generated=(4,)),
        lambda: request(SamplingParams(top_k=1, logprobs=True)),
    ]
    logits = random_logits(5, seed=5)
    logits[2, 4] = 50.0  # the likeliest token until penalised

    def sample() -> list:
        requests = [m() for m in make] + [request(SamplingParams(logprobs=True))]
        requests[-1].matcher = AllowOnly([3, 40])  # type: ignore[assignment]
        return StepSampler(Sampler()).sample([ScheduledChunk(r, 1) for r in requests], logits)

    on_host = sample()
    monkeypatch.setattr(Platform, "on_host", property(lambda self: False))
    assert sample() == on_host
    assert on_host[1][0][0] == 9 and on_host[2][0][0] != 4 and on_host[4][0][0] in (3, 40)


def test_a_mixed_step_through_step_sampler_is_well_formed(device_path):
    params = [SamplingParams(), SamplingParams(temperature=0.9),
              SamplingParams(temperature=1.1, seed=5, logprobs=True),
              SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.1, top_logprobs=3),
              SamplingParams(temperature=0.7, logit_bias=((11, 100.0),), logprobs=True, top_logprobs=1),
              SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5)]
    requests = [request(p) for p in params]
    logits = random_logits(len(params), seed=6)
    results = StepSampler(Sampler()).sample([ScheduledChunk(r, 1) for r in requests], logits)
    assert all(isinstance(result, list) and len(result) == 1 for result in results)
    for p, [(token, logprob, tops)] in zip(params, results, strict=True):
        assert 0 <= token < VOCAB
        assert (logprob is not None) == p.logprobs and (logprob is None or logprob <= 0)
        assert (tops is not None) == bool(p.top_logprobs) and len(tops or ()) == p.top_logprobs
    assert results[0][0][0] == int(logits[0].argmax()) and results[4][0][0] == 11
    top_ids = [token for token, _ in results[3][0][2]]
    assert top_ids == torch.log_softmax(logits[3], -1).topk(3).indices.tolist()


def test_the_device_is_read_once_per_step(monkeypatch):
    """On the meta device, where any read of a value fails, a step with every feature but seeds (a meta
    device has no generators) samples without reading the device but through `to_host`, called once."""
    calls = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.shape)
        return torch.zeros(tensor.shape, dtype=tensor.dtype)

    monkeypatch.setattr(batch_sampler, "to_host", to_host)
    params = [SamplingParams(), SamplingParams(temperature=0.9, logprobs=True),
              SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.1, top_logprobs=3),
              SamplingParams(temperature=0.7, logit_bias=((11, 100.0),)),
              SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5,
                             presence_penalty=0.5)]
    requests = [request(p, generated=(7, 7)) for p in params]
    requests[1].matcher = AllowOnly([3, 40])  # type: ignore[assignment]
    logits = torch.empty(len(params), VOCAB, device="meta")
    results = StepSampler(Sampler()).sample([ScheduledChunk(r, 1) for r in requests], logits)
    assert not any(isinstance(result, Exception) for result in results), results
    assert calls == [torch.Size([len(params), 1 + 1 + 2 * 3])]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these there)")
def test_a_step_on_a_gpu_issues_no_synchronising_copy_but_its_one_read():
    """On a GPU every feature but the final read queues behind the device's work: CUDA's sync debug mode raises
    on a synchronising call (a blocking copy, .item()), and the one read waits on an event, which it allows."""
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=4, logprobs=True),
              SamplingParams(temperature=1.0, top_k=4, top_p=0.7, min_p=0.1, top_logprobs=3),
              SamplingParams(temperature=0.7, logit_bias=((11, 100.0),)),
              SamplingParams(temperature=1.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5)]
    requests = [request(p, generated=(7, 7)) for p in params]
    requests[1].matcher = AllowOnly([3, 40])  # type: ignore[assignment]
    logits = random_logits(len(params), seed=8).cuda()
    sampler = StepSampler(Sampler())
    sampler.sample([ScheduledChunk(r, 1) for r in requests], logits)  # first use: generators, penalty counts
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        results = sampler.sample([ScheduledChunk(r, 1) for r in requests], logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not any(isinstance(result, Exception) for result in results), results
    assert results[1][0][0] in (3, 40) and results[3][0][0] == 11
