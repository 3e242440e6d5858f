"""`restore` on the embedded Gemma 3 270M (exact fp32 weights): the same logits as `full` within 1e-5 of
the largest logit and the same greedy tokens, with prefill chunks and decode steps crossing pages while
the global layers keep only sink + window pages resident (the rest in host memory, then on disk)."""

from pathlib import Path

import pytest
import torch

from kiln import LLM
from kiln.kv.policy import FULL, KVPolicy
from tests.kv.test_restore import Harness, assert_close

pytestmark = pytest.mark.embedded

ROOT = Path(__file__).resolve().parent.parent
PAGE = 16
CHUNKS = [256, 200] + [1] * 8  # 464 tokens: two prefill chunks, then decode across a page boundary


@pytest.fixture(scope="module")
def llm():
    with LLM(quantization=None, kv_budget_bytes=32 * 1024**2, speculative=None) as engine:
        yield engine


def test_restore_equals_full_on_the_embedded_model(llm, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. " * 60
    history = llm.tokenizer.encode(text)[: sum(CHUNKS)]
    assert len(history) == sum(CHUNKS)
    policy = KVPolicy("restore", sink_tokens=16, window_tokens=128)

    def harness(**options: object) -> Harness:
        return Harness(None, tmp_path, model=llm.engine.model, config=llm.engine.model_config, page_size=PAGE, num_pages=256,
                       stream_pages=8, **options)

    full = harness()
    expected = full.feed(full.admit(history, FULL), CHUNKS)
    restored = harness(host_pages=10)
    seq = restored.admit(history, policy)
    got = restored.feed(seq, CHUNKS)
    assert_close(got, expected)
    assert restored.tiers.usage().pages["disk"] > 0
    assert all(len(pages) <= policy.resident_limit(PAGE) for pages in restored.global_resident(seq))
    assert torch.equal(got[-8:].argmax(-1), expected[-8:].argmax(-1))


@pytest.mark.parametrize(("codec", "bound"), [("int8", 0.005), ("int4", 0.02)])
def test_coded_pages_keep_perplexity_on_the_embedded_model(llm, tmp_path, codec, bound):
    """A coded pool (pages resident and in the tiers stored as codes) on real text: teacher-forced
    perplexity within the issue's bounds of the exact pool's (int8 < 0.5 %, int4 < 2 %; measured -0.002 %
    and +0.9 % here), under `full` and `restore`."""
    history = llm.tokenizer.encode((ROOT / "bench/data/perplexity.txt").read_text())[: sum(CHUNKS)]
    targets = torch.tensor(history[1:])

    def perplexity(policy: KVPolicy, **options: object) -> float:
        harness = Harness(None, tmp_path, model=llm.engine.model, config=llm.engine.model_config, page_size=PAGE,
                          num_pages=256, stream_pages=8, **options)
        logits = harness.feed(harness.admit(history, policy), CHUNKS)[:-1]
        return torch.log_softmax(logits, -1).gather(1, targets[:, None]).mean().neg().exp().item()

    exact = perplexity(FULL)
    for policy in (FULL, KVPolicy("restore", sink_tokens=16, window_tokens=128)):
        coded = perplexity(policy, codec=codec, host_pages=10)
        assert abs(coded / exact - 1) < bound, (policy.name, coded, exact)
