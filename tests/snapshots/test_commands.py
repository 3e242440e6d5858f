"""`kiln snapshot list | inspect | gc | export | import` over a directory store of synthetic snapshots."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from kiln.cli import main
from kiln.snapshots import blobs
from kiln.snapshots.instance import default_directory
from kiln.snapshots.local import DirectoryStore
from tests.snapshots.synthetic import page, synthetic


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["snapshot", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("codec", blobs.CODECS)
def test_list_inspect_export_import_gc(tmp_path, capsys, codec):
    source = tmp_path / "a"
    store = DirectoryStore(source)
    store.save(*synthetic("snap-one", [page(1), page(2)], codec=codec))
    store.save(*synthetic("snap-two", [page(2), page(3)], codec=codec))
    code, out, _ = run(capsys, "--snapshot-dir", str(source), "list")
    assert code == 0 and "snap-one" in out and "snap-two" in out
    code, out, _ = run(capsys, "--snapshot-dir", str(source), "inspect", "snap-one")
    summary = json.loads(out)
    assert code == 0 and summary["missing_blobs"] == 0 and summary["groups"][0]["pages"] == 2

    exported = tmp_path / "one.tar"
    assert run(capsys, "--snapshot-dir", str(source), "export", "snap-one", str(exported))[0] == 0
    target = tmp_path / "b"
    code, out, _ = run(capsys, "--snapshot-dir", str(target), "import", str(exported))
    assert code == 0 and "2 new blobs" in out
    assert DirectoryStore(target).get_manifest("snap-one") == store.get_manifest("snap-one")
    imported = DirectoryStore(target).get_blobs(blobs.digest(p) for p in (page(1), page(2)))
    assert {bytes(blobs.decode(blob, digest, len(page(1)))) for digest, blob in imported.items()} == {page(1), page(2)}

    store.delete_manifest("snap-two")
    code, out, _ = run(capsys, "--snapshot-dir", str(source), "gc")
    assert code == 0 and "deleted 1" in out


def test_a_corrupt_or_unknown_export_is_refused(tmp_path, capsys):
    source = DirectoryStore(tmp_path / "a")
    source.save(*synthetic("snap-one", [page(1)]))
    exported = tmp_path / "one.tar"
    run(capsys, "--snapshot-dir", str(tmp_path / "a"), "export", "snap-one", str(exported))
    with tarfile.open(exported) as archive:
        files = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
    blob = next(name for name in files if name.startswith("blobs/"))
    files[blob] = files[blob][:-4]
    broken = tmp_path / "broken.tar"
    with tarfile.open(broken, "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    code, _, err = run(capsys, "--snapshot-dir", str(tmp_path / "b"), "import", str(broken))
    assert code == 2 and "FAILED_PRECONDITION" in err
    assert DirectoryStore(tmp_path / "b").manifest_ids() == []  # nothing stored
    code, _, err = run(capsys, "--snapshot-dir", str(tmp_path / "b"), "import", str(tmp_path / "nothing.tar"))
    assert code == 2 and "INVALID_ARGUMENT" in err
    code, _, err = run(capsys, "--snapshot-dir", str(tmp_path / "a"), "inspect", "snap-none")
    assert code == 2 and "NOT_FOUND" in err


def test_serve_persists_under_the_data_directory_unless_told_otherwise(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_directory("tiny") == tmp_path / "kiln" / "instances" / "tiny" / "snapshots"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_directory() == Path.home() / ".local" / "share" / "kiln" / "instances" / "gemma-3-270m-q4_k_m" / "snapshots"
    code = main(["serve", "--instance-id", "../up", "--model", "unused", "--grpc-port", "0", "--http-port", "0"])
    assert code == 2 and "--instance-id names a directory" in capsys.readouterr().err
    code = main(["serve", "--no-persist", "--snapshot-dir", str(tmp_path), "--model", "unused"])
    assert code == 2 and "--no-persist contradicts" in capsys.readouterr().err


def test_snapshot_commands_use_the_instance_of_the_model_named(monkeypatch, tmp_path, capsys):
    """`kiln snapshot --model M` reads the store `kiln serve --model M` keeps by default, as --instance-id would."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    DirectoryStore(default_directory("smollm2-135m-instruct")).save(*synthetic("smollm2-session", [page(1)]))
    DirectoryStore(default_directory()).save(*synthetic("gemma-session", [page(2)]))
    code, out, _ = run(capsys, "--model", "smollm2-135m-instruct", "list")
    assert code == 0 and "smollm2-session" in out and "gemma-session" not in out
    code, out, _ = run(capsys, "list")  # the embedded default model's instance
    assert code == 0 and "gemma-session" in out and "smollm2-session" not in out
    code, _, err = run(capsys, "--model", "no-such-model", "list")
    assert code == 2 and "no-such-model" in err
