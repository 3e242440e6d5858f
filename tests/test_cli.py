"""`kiln chat` over piped input on a tiny model directory: replies stream, and each turn reports what
it prefilled and what it reused from the session's cache; a model without a chat template is noted as
a base model."""

import os
import re
import subprocess
import sys

from tests.conftest import byte_tokenizer
from tests.tiny_models import tiny_hf_model


def test_chat_reports_prefill_and_reuse_per_turn(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    tiny_hf_model("llama").save_pretrained(model_dir)
    byte_tokenizer().backend.save(str(model_dir / "tokenizer.json"))
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "chat", "--model", str(model_dir), "--max-tokens", "5", "--kv-budget-mb", "8"],
        input="hello there\nand again\n",
        capture_output=True, text=True, timeout=300, check=True, env=env,
    )
    stats = re.findall(r"prefilled (\d+) · reused (\d+) from cache · generated (\d+)", run.stderr)
    assert len(stats) == 2, run.stderr
    (first_prefill, first_reused, generated), (second_prefill, second_reused, _) = [tuple(map(int, s)) for s in stats]
    assert first_reused == 0 and first_prefill > 0 and second_prefill > 0
    # the whole first prompt at least: the conversation's rendering extends it (kiln/chat.py)
    assert first_prefill <= second_reused <= first_prefill + generated - 1
    assert run.stdout.count("model> ") == 2
    assert "is a base model (no chat template)" in run.stderr  # so it chats in a transcript (kiln/chat.py)
