"""A start where the kernels cannot be built falls back to PyTorch ops and says so once: no compiler, a
compiler that fails, or any other failure to build or load. Config resolution, the engine, KV storage and
sampling all agree on the fallback, and the failed build is not tried again in that process."""

from __future__ import annotations

from pathlib import Path

import pytest

import kiln.kernels
from kiln.config import EngineConfig
from kiln.errors import InvalidArgumentError
from tests.kernels.processes import start

WARNING = "Kiln's CPU kernels are off in this process"
COMPILING = "compiling Kiln's CPU kernels"
# Two LLMs over a tiny model, one after the other, as a user's process would make them.
TWO_LLMS = """
from pathlib import Path
from kiln.llm import LLM
from kiln.models.loader import LoadedModel
from tests.conftest import byte_tokenizer
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

loaded = LoadedModel(config=TINY_CONFIGS["llama"], tensors=hf_state_dict(tiny_hf_model("llama")),
                     tokenizer=byte_tokenizer(), source=Path("tiny-llama"), fingerprint="tiny-llama")
for quantization in ("auto", "auto", None):
    llm = LLM(loaded=loaded, kv_budget_bytes=16 * 1024**2, quantization=quantization)
    text = llm.generate("hello", max_tokens=4, temperature=0.0)[0].text
    print("generated", llm.config.quantization, llm.config.kv_dtype, llm.config.fused_kernels, len(text), flush=True)
    llm.close()
"""


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's kernels as if their build had failed."""
    library = kiln.kernels._Library()
    library._outcome = kiln.kernels._Outcome(None, "a simulated build failure")
    monkeypatch.setattr(kiln.kernels, "_library", library)


def test_without_kernels_auto_resolves_to_the_exact_path(kernels_off: None) -> None:
    config = EngineConfig()
    assert (config.quantization, config.kv_dtype, config.fused_kernels) == (None, None, False)
    with pytest.raises(InvalidArgumentError, match="quantization 'int8' runs on Kiln's CPU kernels, which are unavailable "
                                                   r"here \(a simulated build failure\)"):
        EngineConfig(quantization="int8")
    with pytest.raises(InvalidArgumentError, match="deterministic needs"):
        EngineConfig(deterministic=True)


def broken_compiler(tmp_path: Path) -> tuple[str, Path]:
    """A C++ compiler that answers version queries and fails every compile, logging each call."""
    log = tmp_path / "compiler.log"
    script = tmp_path / "broken-c++"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {log}
for arg in "$@"; do
  if [ "$arg" = "-c" ]; then echo "broken-c++: a simulated compile error" >&2; exit 1; fi
done
exec c++ "$@"
""")
    script.chmod(0o755)
    return str(script), log


def test_a_failed_build_falls_back_warns_once_and_is_not_retried(tmp_path: Path) -> None:
    compiler, log = broken_compiler(tmp_path)
    run = start(tmp_path / "run", tmp_path / "extensions", code=TWO_LLMS, CXX=compiler)
    assert run.wait(300) == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == ["generated None None False 4"] * 3  # exact path, every time
    assert run.stderr.count(WARNING) == 1
    assert "quantization 'auto' falls back to None" in run.stderr
    (home,) = (tmp_path / "extensions" / "kiln").iterdir()
    assert "broken-c++: a simulated compile error" in (home / "build-failure.log").read_text()  # the whole output, kept
    assert run.stderr.count(COMPILING) == 1  # one attempt in the process, whatever asked afterwards
    assert log.read_text()  # the compiler was asked (and failed)


def test_without_a_compiler_nothing_is_built_and_the_warning_names_the_cause(tmp_path: Path) -> None:
    code = "from kiln.config import EngineConfig; print(EngineConfig().quantization)"
    run = start(tmp_path / "run", tmp_path / "extensions", code=code, CXX="no-such-c++-compiler")
    assert run.wait(120) == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["None"]
    assert run.stderr.count(WARNING) == 1
    assert "no C++ compiler" in run.stderr and "no-such-c++-compiler" in run.stderr
    assert COMPILING not in run.stderr
