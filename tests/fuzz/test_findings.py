"""What the fuzzers found, each as a fixed reproducer (they fail on the code before the fix).

1. `/v1/completions` with several prompts, a later one refused (an empty prompt: "nothing to generate
   from"): 500 (`AttributeError: 'list' object has no attribute 'cancel'` in start_all, which was
   handed each prompt's group of choices), and the earlier prompts' generations ran on, orphaned.
   Found by test_route[POST /v1/completions-valid] at 60 examples.
"""

from __future__ import annotations

import time

from tests.fuzz.conftest import REQUEST_TIMEOUT_S, FuzzTarget

GENERATIONS = "kiln_generations_total"


def generations(target: FuzzTarget, reason: str) -> float:
    text = target.http.get(target.url + "/metrics", timeout=REQUEST_TIMEOUT_S).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(GENERATIONS) and f'reason="{reason}"' in line)


def test_a_refused_later_prompt_cancels_the_earlier_ones(fuzz_target: FuzzTarget) -> None:
    before = {reason: generations(fuzz_target, reason) for reason in ("cancelled", "length")}
    reply = fuzz_target.post("/v1/completions", {"prompt": ["a long one", ""], "max_tokens": 900, "ignore_eos": True})
    assert reply.status_code == 400, reply.text
    assert "nothing to generate from" in reply.json()["error"]["message"]
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while generations(fuzz_target, "cancelled") == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert generations(fuzz_target, "cancelled") == before["cancelled"] + 1, "the first prompt's generation ran on"
    assert generations(fuzz_target, "length") == before["length"]
    fuzz_target.check_unharmed()
