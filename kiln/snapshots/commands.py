"""`kiln snapshot list | inspect ID | gc | export ID FILE | import FILE`: the store seen by its operator
(every owner's snapshots, sessions' own included), without loading a model.

An export is one portable file: an uncompressed tar of `manifest.json` and `blobs/<digest>.zst`, every
blob the manifest references as the store holds it (a raw page or a zstd frame, blobs.py; the name is
format 1's, so exports of either format import). Import verifies each blob (decoded size and SHA-256) before it
stores anything, then saves like a server would: blobs first, manifest last.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import time
from pathlib import Path

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.snapshots import blobs
from kiln.snapshots.manifest import Manifest, check_snapshot_id
from kiln.snapshots.store import SnapshotStore, default_directory, open_store


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("snapshot", help="list, inspect, export, import and garbage-collect snapshots")
    parser.add_argument("--snapshot-dir", default=None, help=f"snapshot directory (default {default_directory()})")
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


def run(args: argparse.Namespace) -> None:
    store = open_store(args.snapshot_store or args.snapshot_dir or default_directory())
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
        _add(archive, "manifest.json", manifest.to_json())
        for digest in sorted(manifest.digests()):
            blob = store.get_blob(digest)
            if blob is None:
                raise FailedPreconditionError(f"snapshot {manifest.snapshot_id}: page blob {digest[:16]} is missing")
            _add(archive, f"blobs/{digest}.zst", blob)
    return f"exported {manifest.snapshot_id} ({manifest.page_count()} pages) to {args.file}"


def import_file(store: SnapshotStore, args: argparse.Namespace) -> str:
    try:
        with tarfile.open(args.file, "r") as archive:
            files = {member.name: archive.extractfile(member).read() for member in archive.getmembers() if member.isfile()}
    except (OSError, tarfile.TarError) as error:
        raise InvalidArgumentError(f"{args.file} is not a snapshot export: {error}") from None
    if "manifest.json" not in files:
        raise InvalidArgumentError(f"{args.file} is not a snapshot export: no manifest.json")
    manifest = Manifest.from_json(files["manifest.json"], Path(args.file).name)
    stored = {}
    for digest in manifest.digests():
        blob = files.get(f"blobs/{digest}.zst")
        if blob is None:
            raise FailedPreconditionError(f"{args.file}: page blob {digest[:16]} is missing")
        blobs.decode(blob, digest, manifest.shape.page_bytes)  # verified before anything is stored
        stored[digest] = blob
    report = store.save(manifest, stored)
    return f"imported {manifest.snapshot_id} ({report.blobs_written} new blobs, {report.blobs_deduplicated} already stored)"


def _add(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    archive.addfile(info, io.BytesIO(data))


ACTIONS = {"list": list_snapshots, "inspect": inspect, "gc": gc, "export": export, "import": import_file}
