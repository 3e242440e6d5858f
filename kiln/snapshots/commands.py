"""`kiln snapshot list | inspect ID | gc | export ID FILE | import FILE`: the store seen by its operator
(every owner's snapshots, sessions' own included), without loading a model.

An export is one portable file: an uncompressed tar of `manifest.json` and `blobs/<digest>.zst`, every
blob the manifest references as the store holds it (a raw page or a zstd frame, blobs.py; the name is
format 1's, so exports of either format import). Import reads the file as a stream in bounded steps and
verifies the manifest and each blob (decoded size and SHA-256, in bounded memory) before it stores
anything (`read_export`), then saves like a server would: blobs first, manifest last.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.snapshots import blobs
from kiln.snapshots.instance import default_directory, instance_for_model
from kiln.snapshots.manifest import MAX_MANIFEST_BYTES, Manifest, check_snapshot_id
from kiln.snapshots.store import SnapshotStore, open_store


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("snapshot", help="list, inspect, export, import and garbage-collect snapshots")
    parser.add_argument("--snapshot-dir", default=None,
                        help="snapshot directory (default: --instance-id's own, as kiln serve's)")
    parser.add_argument("--instance-id", default=None,
                        help="the `kiln serve` instance whose own snapshot directory to use (kiln/snapshots/instance.py; "
                        "default: --model's, as kiln serve names its instance)")
    parser.add_argument("--model", default=None,
                        help="the model of the `kiln serve` whose default instance to use, as its --model takes it "
                        "(default: the embedded gemma3-270m); only its name is resolved, nothing is loaded")
    parser.add_argument("--snapshot-store", default=None, help="snapshot store URL instead (redis://host:port/db)")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every snapshot in the store")
    inspect = actions.add_parser("inspect", help="one snapshot's manifest, and whether its blobs are all there")
    inspect.add_argument("snapshot_id")
    actions.add_parser("gc", help="delete blobs no manifest references (safe while servers write; deletes nothing, "
                                  "naming them, while any manifest is unreadable)")
    export = actions.add_parser("export", help="write one snapshot and its blobs to a portable file")
    export.add_argument("snapshot_id")
    export.add_argument("file")
    imported = actions.add_parser("import", help="store a snapshot from an exported file")
    imported.add_argument("file")
    parser.set_defaults(run=run)


MANIFEST_MEMBER = "manifest.json"
# What a compressed file starts with: an export is never compressed (its pages are, where that pays), and a
# compressed archive would have to be inflated, whatever size it claims, before its members could be read.
COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


def run(args: argparse.Namespace) -> None:
    instance = args.instance_id or instance_for_model(args.model)
    store = open_store(args.snapshot_store or args.snapshot_dir or default_directory(instance))
    try:
        print(ACTIONS[args.action](store, args))
    finally:
        store.close()


def list_snapshots(store: SnapshotStore, args: argparse.Namespace) -> str:
    rows = [f"{'id':<48} {'kind':<10} {'tokens':>7} {'kv':>7} {'pages':>6}  created"]
    for m in sorted(store.manifests(), key=lambda m: m.created_at):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at))
        rows.append(f"{m.snapshot_id:<48} {m.kind:<10} {len(m.token_ids):>7} {m.num_computed:>7} {m.page_count():>6}  {created}")
    return "\n".join(rows)


def inspect(store: SnapshotStore, args: argparse.Namespace) -> str:
    manifest = store.require_manifest(check_snapshot_id(args.snapshot_id))
    summary = {key: value for key, value in json.loads(manifest.to_json()).items() if key not in ("token_ids", "groups")}
    summary["history_tokens"] = len(manifest.token_ids)
    summary["groups"] = [{"layers": g.layers, "window": g.window, "pages": len(g.pages),
                          "released": sum(d is None for d in g.pages)} for g in manifest.groups]
    summary["missing_blobs"] = len(store.missing(manifest.digests()))
    return json.dumps(summary, indent=2)


def gc(store: SnapshotStore, args: argparse.Namespace) -> str:
    report = store.gc()
    return (f"{report.manifests} manifests; kept {report.blobs_kept} blobs, deleted {report.blobs_deleted} "
            f"({report.bytes_freed / 2**20:.1f} MiB freed)")


def export(store: SnapshotStore, args: argparse.Namespace) -> str:
    manifest = store.require_manifest(check_snapshot_id(args.snapshot_id))
    with tarfile.open(args.file, "w") as archive:
        _add(archive, MANIFEST_MEMBER, manifest.to_json())
        for digest in sorted(manifest.digests()):
            blob = store.get_blob(digest)
            if blob is None:
                raise FailedPreconditionError(f"snapshot {manifest.snapshot_id}: page blob {digest[:16]} is missing")
            _add(archive, f"blobs/{digest}.zst", blob)
    return f"exported {manifest.snapshot_id} ({manifest.page_count()} pages) to {args.file}"


def import_file(store: SnapshotStore, args: argparse.Namespace) -> str:
    manifest, stored = read_export(Path(args.file))
    report = store.save(manifest, stored)
    return f"imported {manifest.snapshot_id} ({report.blobs_written} new blobs, {report.blobs_deduplicated} already stored)"


def read_export(path: Path) -> tuple[Manifest, dict[str, bytes]]:
    """An export's manifest and blobs, every one verified before anything is stored, read as a stream in
    bounded steps: `manifest.json` first (at most MAX_MANIFEST_BYTES, validated), then only the blobs it
    names, each at most a page's worst-case zstd frame and checked in bounded memory (blobs.verify).
    Anything else refuses the file: a compressed archive, another member, a link, a pax or GNU header
    (which tarfile would read whole, whatever size it claims). InvalidArgumentError for what is not an
    export, FailedPreconditionError for an export whose contents fail verification."""
    where = path.name
    try:
        with open(path, "rb") as file:
            head = file.read(8)
            kind = next((name for magic, name in COMPRESSED.items() if head.startswith(magic)), None)
            if kind is not None:
                raise InvalidArgumentError(f"{where} is {kind}-compressed; an export is an uncompressed tar "
                                           "(as `kiln snapshot export` writes it): decompress it first")
            file.seek(0)
            members = _members(file, where)
            first = next(members, None)
            if first is None or first.name != MANIFEST_MEMBER:
                raise InvalidArgumentError(f"{where} is not a snapshot export: its first member is not {MANIFEST_MEMBER}")
            manifest = Manifest.from_json(_read(file, first, MAX_MANIFEST_BYTES, where), where)
            wanted = {f"blobs/{digest}.zst": digest for digest in manifest.digests()}
            limit = blobs.max_blob_bytes(manifest.shape.page_bytes)
            found: dict[str, bytes] = {}
            for member in members:
                digest = wanted.get(member.name)
                if digest is None or digest in found:
                    raise InvalidArgumentError(f"{where}: member {member.name[:80]!r} is not a blob its manifest "
                                               "names (or is there twice)")
                found[digest] = _read(file, member, limit, where)
                blobs.verify(found[digest], digest, manifest.shape.page_bytes)
    except OSError as error:
        raise InvalidArgumentError(f"{where} is not a snapshot export: {error}") from None
    lost = wanted.values() - found.keys()
    if lost:
        raise FailedPreconditionError(f"{where}: page blob {min(lost)[:16]} is missing")
    return manifest, found


def _members(file: BinaryIO, where: str) -> Iterator[tarfile.TarInfo]:
    """The members of an uncompressed tar, one header at a time (the caller reads each one's data with
    `_read` before asking for the next): plain files only."""
    while (block := file.read(tarfile.BLOCKSIZE)) and block.count(0) != len(block):
        try:
            member = tarfile.TarInfo.frombuf(block, "utf-8", "strict")
        except (tarfile.HeaderError, UnicodeDecodeError) as error:
            raise InvalidArgumentError(f"{where} is not a snapshot export: a damaged tar header ({error})") from None
        if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise InvalidArgumentError(f"{where}: member {member.name[:80]!r} is not a plain file (links, folders, "
                                       "pax and GNU headers are refused)")
        yield member


def _read(file: BinaryIO, member: tarfile.TarInfo, limit: int, where: str) -> bytes:
    """A member's data, refused unread if it claims more than `limit` bytes."""
    if member.size > limit:
        raise InvalidArgumentError(f"{where}: member {member.name[:80]!r} claims {member.size} bytes, more than the "
                                   f"{limit} it may hold")
    data = file.read(member.size)
    if len(data) != member.size:
        raise InvalidArgumentError(f"{where} is truncated (in {member.name[:80]!r})")
    file.seek(-member.size % tarfile.BLOCKSIZE, io.SEEK_CUR)
    return data


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    archive.addfile(info, io.BytesIO(data))


ACTIONS = {"list": list_snapshots, "inspect": inspect, "gc": gc, "export": export, "import": import_file}
