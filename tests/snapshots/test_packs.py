"""The directory store's packs and the blob codecs: a damaged pack is refused (typed error, never wrong
bytes), gc keeps a pack while any manifest names a page in it, and a store written by format 1 (one zstd
file per blob; the fixture was written by the code before packs) is read, saved over and collected."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from kiln.errors import FailedPreconditionError
from kiln.snapshots import blobs, packs
from kiln.snapshots.store import open_store
from tests.snapshots.synthetic import PAGE_BYTES, blob_place, flip_blob_byte, page, stored_digests, synthetic

FORMAT1 = Path(__file__).parent / "fixtures" / "format1"


def digests(*seeds: int) -> set[str]:
    return {blobs.digest(page(n)) for n in seeds}


def test_a_flipped_byte_in_a_blob_is_a_corrupt_blob_error(tmp_path):
    store = open_store(tmp_path)
    store.save(*synthetic("snap-a", [page(1), page(2)]))
    digest = blobs.digest(page(2))
    flip_blob_byte(tmp_path, digest)
    blob = open_store(tmp_path).get_blobs([digest])[digest]
    with pytest.raises(FailedPreconditionError, match="corrupt"):
        blobs.decode(blob, digest, PAGE_BYTES)
    assert blobs.decode(store.get_blob(blobs.digest(page(1))), blobs.digest(page(1)), PAGE_BYTES) == page(1)


@pytest.mark.parametrize("where", ["index", "trailer"])
def test_a_pack_with_a_damaged_index_holds_nothing_and_gc_keeps_it(tmp_path, where):
    store = open_store(tmp_path)
    store.save(*synthetic("snap-a", [page(1), page(2)]))
    path, _ = blob_place(tmp_path, blobs.digest(page(1)))
    data = bytearray(path.read_bytes())
    data[len(data) - packs.TRAILER.size - (packs.ENTRY.size if where == "index" else -1)] ^= 0x01
    path.write_bytes(bytes(data))
    with open(path, "rb") as file, pytest.raises(FailedPreconditionError, match="snapshot pack"):
        packs.read_index(file, len(data), path.name)
    reopened = open_store(tmp_path)
    assert reopened.missing(digests(1, 2)) == digests(1, 2)
    assert reopened.get_blobs(digests(1, 2)) == {}
    reopened.delete_manifest("snap-a")
    reopened.gc()
    assert path.exists()  # which blobs it holds is unknown: gc deletes nothing it cannot read


def test_gc_keeps_a_pack_while_a_page_in_it_is_named_and_rewrites_mostly_dead_ones(tmp_path):
    store = open_store(tmp_path)
    store.save(*synthetic("snap-a", [page(1), page(2), page(3), page(4)]))
    store.save(*synthetic("snap-b", [page(1), page(5)]))  # page 1 is deduplicated: not packed again
    store.save(*synthetic("snap-c", [page(6), page(7), page(8)]))
    store.save(*synthetic("snap-d", [page(6), page(7)]))
    assert sorted(stored_digests(tmp_path)) == sorted(digests(1, 2, 3, 4, 5, 6, 7, 8))
    store.delete_manifest("snap-a")
    store.delete_manifest("snap-c")
    report = store.gc()
    # snap-a's pack had one live page of four: rewritten with page 1 alone; snap-c's keeps two of three
    assert sorted(stored_digests(tmp_path)) == sorted(digests(1, 5, 6, 7, 8))
    assert (report.manifests, report.blobs_kept, report.blobs_deleted) == (2, 4, 3)
    for name in ("snap-b", "snap-d"):
        manifest = open_store(tmp_path).require_manifest(name)
        found = open_store(tmp_path).get_blobs(manifest.digests())
        assert {blobs.decode(found[d], d, PAGE_BYTES) for d in manifest.digests()} == {
            page(n) for n in ((1, 5) if name == "snap-b" else (6, 7))}


def test_a_format1_store_is_read_saved_over_and_collected(tmp_path):
    root = tmp_path / "store"
    shutil.copytree(FORMAT1, root)
    store = open_store(root)
    manifest = store.require_manifest("format1-kept")
    assert (manifest.format_version, manifest.codec) == (1, "zstd")
    found = store.get_blobs(manifest.digests())
    assert {blobs.decode(found[d], d, PAGE_BYTES) for d in manifest.digests()} == {page(1), page(2)}
    assert store.missing(digests(1, 2, 3)) == set()  # page 3's blob is garbage, not yet collected
    report = store.save(*synthetic("format2", [page(1), page(4)]))
    assert (report.blobs_written, report.blobs_deduplicated) == (1, 1)
    gc = store.gc()
    assert (gc.manifests, gc.blobs_kept, gc.blobs_deleted) == (2, 3, 1)
    assert store.missing(digests(1, 2, 3, 4)) == digests(3)
    assert store.require_manifest("format2").format_version == 2


def test_float_pages_are_stored_raw_and_compressible_ones_compressed():
    noise = [torch.randn(PAGE_BYTES * 8, generator=torch.Generator().manual_seed(n)).half().numpy().tobytes()
             for n in range(4)]
    assert blobs.choose_codec(noise) == blobs.CODEC_RAW
    assert blobs.choose_codec([bytes(PAGE_BYTES)] * 4) == blobs.CODEC_ZSTD
    for codec in blobs.CODECS:
        blob = blobs.encode(noise[0], codec)
        assert bytes(blobs.decode(blob, blobs.digest(noise[0]), len(noise[0]))) == noise[0]
        assert (blob is noise[0]) == (codec == blobs.CODEC_RAW)  # a raw page is stored as it is, not copied
    damaged = bytearray(noise[0])
    damaged[7] ^= 0x01
    with pytest.raises(FailedPreconditionError, match="corrupt"):
        blobs.decode(bytes(damaged), blobs.digest(noise[0]), len(noise[0]))


def test_another_process_store_sees_new_packs_and_removed_ones(tmp_path):
    writer, reader = open_store(tmp_path), open_store(tmp_path)
    assert reader.missing(digests(1, 2)) == digests(1, 2)  # the reader has just listed packs/
    writer.save(*synthetic("snap-a", [page(1), page(2)]))
    assert set(reader.get_blobs(digests(1, 2))) == digests(1, 2)  # not indexed yet: listed again
    assert reader.missing(digests(1, 2)) == set()
    writer.delete_manifest("snap-a")
    writer.gc()
    assert reader.missing(digests(1, 2)) == digests(1, 2)  # the pack it indexed is gone
    assert reader.get_blobs(digests(1, 2)) == {}
