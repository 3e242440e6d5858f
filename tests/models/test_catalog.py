"""Models by name (kiln/models/catalog.py) and what `kiln models` says of each (kiln/models/facts.py).

Resolution order: an embedded name, then the models directory ($KILN_MODELS_DIR: *.gguf by stem, HF
directories by folder name), then a path; anything else is refused listing the names there are. The
facts come from file headers and must equal what gguf-py's full reader and the safetensors files say.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from kiln.cli import main
from kiln.errors import InvalidArgumentError
from kiln.models.catalog import UnknownModelError, available_models, models_directory, resolve
from kiln.models.embedded import EMBEDDED_MODELS
from kiln.models.facts import model_facts
from kiln.models.loader import load_model
from kiln.snapshots.instance import EMBEDDED_INSTANCE, instance_for_model
from tests.models.test_loader import save_hf_dir
from tests.tiny_gguf import write_gguf
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

EMBEDDED_NAMES = ["gemma3-270m", "smollm2-135m-instruct"]


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A models directory holding a Q8_0 GGUF (`tiny-gguf`), a bf16 HF directory sharded in three
    (`tiny-hf`), a file and a folder that are no models, and a GGUF named like an embedded model."""
    directory = tmp_path / "models"
    directory.mkdir()
    write_gguf(directory / "tiny-gguf.gguf", "llama", TINY_CONFIGS["llama"], hf_state_dict(tiny_hf_model("llama")),
               quantize=True)
    save_hf_dir(tiny_hf_model("qwen3").to(torch.bfloat16), directory / "tiny-hf", max_shard_size="20KB")
    (directory / "notes.txt").write_text("not a model")
    (directory / "empty").mkdir()
    shutil.copy(directory / "tiny-gguf.gguf", directory / "smollm2-135m-instruct.gguf")
    monkeypatch.setenv("KILN_MODELS_DIR", str(directory))
    return directory


def test_names_resolve_embedded_then_models_directory_then_path(models_dir, tmp_path, monkeypatch):
    assert [entry.name for entry in available_models()] == [*EMBEDDED_NAMES, "tiny-gguf", "tiny-hf"]
    assert resolve(None).embedded is EMBEDDED_MODELS["gemma3-270m"]
    shadowed = resolve("smollm2-135m-instruct")  # the embedded model, not the directory's file of that name
    assert shadowed.origin == "embedded" and shadowed.path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve("tiny-gguf").path() == models_dir / "tiny-gguf.gguf"
    assert resolve("tiny-hf").path() == models_dir / "tiny-hf"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-hf").mkdir()  # a folder of the working directory by the same name: the name wins
    assert resolve("tiny-hf").origin == "models directory"
    by_path = resolve(str(models_dir / "tiny-gguf.gguf"))
    assert (by_path.origin, by_path.name, by_path.path()) == ("path", "tiny-gguf", models_dir / "tiny-gguf.gguf")


def test_an_unknown_name_is_refused_listing_the_names(models_dir):
    with pytest.raises(UnknownModelError) as refused:
        resolve("llama3.2")
    assert refused.value.available == [*EMBEDDED_NAMES, "tiny-gguf", "tiny-hf"]
    assert refused.value.code == "INVALID_ARGUMENT" and refused.value.param == "model"
    message = str(refused.value)
    assert "'llama3.2'" in message and str(models_dir) in message
    assert "available: gemma3-270m, smollm2-135m-instruct, tiny-gguf, tiny-hf" in message


def test_a_name_two_models_share_is_refused(models_dir):
    shutil.copytree(models_dir / "tiny-hf", models_dir / "tiny-gguf")
    with pytest.raises(InvalidArgumentError, match="2 models of the models directory are named 'tiny-gguf'"):
        resolve("tiny-gguf")


def test_the_models_directory_defaults_under_the_data_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("KILN_MODELS_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert models_directory() == tmp_path / "data" / "kiln" / "models"
    assert [entry.name for entry in available_models()] == EMBEDDED_NAMES  # the directory need not exist


def test_load_model_and_instances_take_names(models_dir, tmp_path):
    loaded = load_model("tiny-hf", cache_dir=tmp_path / "cache")
    assert (loaded.source, loaded.catalog_name, loaded.display_name) == (models_dir / "tiny-hf", "tiny-hf", "tiny-hf")
    by_path = load_model(models_dir / "tiny-hf", cache_dir=tmp_path / "cache")
    assert by_path.catalog_name is None and by_path.fingerprint == loaded.fingerprint
    gguf_by_name = load_model("tiny-gguf", cache_dir=tmp_path / "cache")  # what the API calls it: that name
    assert gguf_by_name.display_name == "tiny-gguf" != gguf_by_name.config.name == "tiny llama"
    assert load_model(models_dir / "tiny-gguf.gguf", cache_dir=tmp_path / "cache").display_name == "tiny llama"
    assert instance_for_model("tiny-gguf") == "tiny-gguf"
    assert instance_for_model(None) == instance_for_model("gemma3-270m") == EMBEDDED_INSTANCE
    assert instance_for_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(UnknownModelError):
        instance_for_model("no-such-model")


def test_gguf_facts_equal_gguf_py_and_the_hf_facts_the_safetensors(models_dir):
    gguf_file = models_dir / "tiny-gguf.gguf"
    reader = gguf.GGUFReader(gguf_file)
    facts = model_facts(gguf_file)
    assert facts.parameters == sum(int(tensor.n_elements) for tensor in reader.tensors)
    assert (facts.architecture, facts.weight_type, facts.context_length, facts.chat_template) == (
        "llama", "Q8_0", TINY_CONFIGS["llama"].max_position_embeddings, False)
    assert facts.size_bytes == gguf_file.stat().st_size
    hf = model_facts(models_dir / "tiny-hf")
    model = tiny_hf_model("qwen3")
    tied = model.model.embed_tokens.weight.numel()  # saved once: the LM head is tied to it
    assert hf.parameters == sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in model.state_dict().values()) - tied
    assert (hf.architecture, hf.weight_type, hf.context_length, hf.chat_template) == ("qwen3", "BF16", 1024, True)
    assert hf.size_bytes == sum(f.stat().st_size for f in (models_dir / "tiny-hf").iterdir())
    smollm2 = model_facts(EMBEDDED_MODELS["smollm2-135m-instruct"].path())
    assert (smollm2.architecture, smollm2.parameters, smollm2.weight_type, smollm2.context_length,
            smollm2.chat_template) == ("llama", 134_515_008, "Q4_1", 8192, True)


def test_a_damaged_gguf_is_refused(tmp_path):
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(InvalidArgumentError, match="not a readable GGUF file"):
        model_facts(damaged)


def test_kiln_models_lists_every_name_with_its_facts(models_dir, capsys):
    (models_dir / "broken.gguf").write_bytes(b"not a gguf")
    assert main(["models", "--json"]) == 0
    rows = {row["name"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == [*EMBEDDED_NAMES, "broken", "tiny-gguf", "tiny-hf"]
    assert rows["tiny-gguf"] == {"name": "tiny-gguf", "origin": "models directory",
                                 **model_facts(models_dir / "tiny-gguf.gguf").to_json(),
                                 "path": str(models_dir / "tiny-gguf.gguf")}
    assert rows["smollm2-135m-instruct"]["chat_template"] is True
    assert "not a readable GGUF file" in rows["broken"]["error"]
    assert main(["models"]) == 0
    table = capsys.readouterr()
    lines = table.out.splitlines()
    assert lines[0].split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "CONTEXT", "CHAT", "TEMPLATE", "SIZE",
                                "FROM"]
    assert next(line for line in lines if line.startswith("tiny-hf ")).split() == [
        "tiny-hf", "qwen3", f"{rows['tiny-hf']['parameters'] / 1e6:.1f}M", "BF16", "1024", "yes", "0", "MiB",
        "models", "directory"]
    assert f"models directory: {models_dir}" in table.err


@pytest.mark.parametrize("command", [["serve", "--grpc-port", "0", "--http-port", "0"], ["chat"],
                                     ["generate", "--prompt", "x"], ["fleet"]])
def test_every_command_refuses_an_unknown_name_listing_the_names(command, models_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert main([*command, "--model", "llama3.2"]) == 2
    assert ("kiln: INVALID_ARGUMENT: no model named 'llama3.2'" in (err := capsys.readouterr().err)
            and "available: gemma3-270m, smollm2-135m-instruct, tiny-gguf, tiny-hf" in err), err
