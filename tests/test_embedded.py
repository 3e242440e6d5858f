"""The embedded Gemma 3 270M end to end: Kiln's greedy tokens equal HF transformers' on the same
dequantised weights, and the CLI prints the greedy continuation."""

import subprocess
import sys

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.hf_config import hf_config_dict

pytestmark = pytest.mark.embedded

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm():
    with LLM(quantization=None, kv_budget_bytes=256 * 1024**2) as engine:
        yield engine


def hf_greedy(llm: LLM, prompt_ids: list[int]) -> list[int]:
    """Greedy tokens from transformers' Gemma3ForCausalLM with our dequantised weights, full forward
    every step (no cache), so nothing of Kiln's machinery is shared with the reference."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config_dict(llm.loaded.config))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(llm.loaded.tensors, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def test_greedy_tokens_match_transformers(llm):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    ours = [out.token_ids for out in llm.generate(prompt_ids, params)]
    for prompt, tokens in zip(prompt_ids, ours, strict=True):
        assert tokens == hf_greedy(llm, prompt)
    assert "France" in llm.tokenizer.decode(ours[0])  # readable text, not noise


def test_session_turns_reuse_history_on_the_embedded_model(llm):
    session = llm.create_session()
    session.append_text("The capital of France is")
    first = session.generate(max_tokens=8).result()
    session.append_text(" And the capital of Italy is")
    second = session.generate(max_tokens=8).result()
    assert second.usage.reused_tokens == first.usage.prompt_tokens + len(first.token_ids) - 1
    assert second.usage.prefilled_tokens == len(session.tokens) - len(second.token_ids) - second.usage.reused_tokens
    session.close()


def test_cli_generate_prints_greedy_continuation(llm):
    expected = llm.generate("The capital of France is", max_tokens=16)[0].text
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "generate", "--prompt", "The capital of France is", "--max-tokens", "16",
         "--temperature", "0", "--kv-budget-mb", "64", "--quantization", "none"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert run.stdout.strip() == expected.strip()
