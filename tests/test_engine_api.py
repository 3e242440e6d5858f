"""Code outside kiln/engine and kiln/kv talks to the engine only through its narrow public API (submit,
cancel, stats, the session-facing sequence operations, ...), never through its internals
(`llm.engine.cache.pool...`, `engine.scheduler`, `engine._lock`). Checked on the source with `ast`."""

import ast
from pathlib import Path

from kiln.engine.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
# Directories whose code may use engine internals: the engine and KV cache themselves, and their tests.
INSIDE = ("kiln/engine", "kiln/kv", "tests/engine", "tests/kv", "tests/models")
INSTANCE_API = {"config", "model_config", "tokenizer", "model", "max_model_len", "stats"}


def public_api() -> set[str]:
    return {name for name in vars(Engine) if not name.startswith("_")} | INSTANCE_API


def outside_files() -> list[Path]:
    files = [p for d in ("kiln", "bench", "tests") for p in sorted((ROOT / d).rglob("*.py"))]
    return [p for p in files if not p.relative_to(ROOT).as_posix().startswith(INSIDE)]


def reach_ins(source: str, api: set[str]) -> list[tuple[int, str]]:
    """(line, `engine.name`) of each attribute read through something called `engine` that is not API."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr not in api:
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
            if name == "engine":
                found.append((node.lineno, f"engine.{node.attr}"))
    return sorted(found)


def test_reach_in_finder_sees_internals():
    api = public_api()
    assert reach_ins("llm.engine.cache.pool.usage()\nengine._lock\nx = self.engine.scheduler", api) == [
        (1, "engine.cache"), (2, "engine._lock"), (3, "engine.scheduler")]
    assert reach_ins("llm.engine.kv_usage()\nengine.submit(seq, p, emit)\nengine.stats.steps", api) == []


def test_nothing_outside_the_engine_reaches_into_it():
    api = public_api()
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in outside_files()
        for line, what in reach_ins(path.read_text(), api)
    ]
    assert not offenders, "engine internals used outside kiln/engine and kiln/kv:\n" + "\n".join(offenders)
