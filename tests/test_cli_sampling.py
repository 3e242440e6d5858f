"""The CLI's sampling flags (--min-p, --repetition-penalty, --presence-penalty, --frequency-penalty): they
reach the engine (`kiln generate` prints what SamplingParams with them generates in process), and an
out-of-range value is refused naming its field before any model loads."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.cli import main
from tests.conftest import byte_tokenizer
from tests.tiny_models import tiny_hf_model

CONTROLS = {"repetition_penalty": 1.8, "presence_penalty": 1.5, "frequency_penalty": 0.7, "min_p": 0.2}
ENGINE = ["--quantization", "none", "--speculative", "none", "--kv-budget-mb", "8"]


def test_generate_applies_the_sampling_flags(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    model_dir = tmp_path / "tiny-llama"
    tiny_hf_model("llama").save_pretrained(model_dir)
    byte_tokenizer().backend.save(str(model_dir / "tokenizer.json"))
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in CONTROLS.items()]
    assert main(["generate", "--model", str(model_dir), "--prompt", "ab ab ab", "--max-tokens", "12", *ENGINE, *flags]) == 0
    printed = capsys.readouterr().out
    with LLM(str(model_dir), quantization=None, speculative=None, kv_budget_bytes=8 << 20) as llm:
        prompt = llm.tokenizer.encode("ab ab ab")
        penalised = llm.generate(prompt, SamplingParams(max_tokens=12, **CONTROLS))[0]
        plain = llm.generate(prompt, SamplingParams(max_tokens=12))[0]
    assert printed == penalised.text + "\n"
    assert penalised.token_ids != plain.token_ids


@pytest.mark.parametrize(("command", "flag", "field"), [
    ("generate", "--min-p=1.5", "min_p"),
    ("generate", "--repetition-penalty=0", "repetition_penalty"),
    ("chat", "--presence-penalty=2.5", "presence_penalty"),
    ("chat", "--frequency-penalty=-3", "frequency_penalty"),
])
def test_out_of_range_flags_are_refused_naming_the_field(tmp_path, capsys, command: str, flag: str, field: str) -> None:
    prompt = ["--prompt", "x"] if command == "generate" else []
    assert main([command, "--model", str(tmp_path / "no-such-model"), *prompt, flag]) == 2
    error = capsys.readouterr().err
    assert error.startswith("kiln: INVALID_ARGUMENT:") and field in error
