"""Restore: a manifest and its blobs back into a KVImage, verified completely before anything is loaded.

Checked, each a typed error naming what differs: every field's type and range, page counts and sizes
against the shape (the manifest parser, Manifest.from_json), the KV format fingerprint and every shape
field (another model, weight format, KV dtype, page size or layout is FailedPreconditionError), the KV groups, the policy, token ids against this vocabulary and
context (InvalidArgumentError), every page the next step reads being present, and each blob's size (this
engine's page) and SHA-256 after decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch

from kiln.engine.engine import Engine
from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.kv.image import KVImage
from kiln.kv.policy import KVPolicy
from kiln.snapshots import blobs
from kiln.snapshots.manifest import KVShape, Manifest
from kiln.snapshots.store import SnapshotStore

Mapper = Callable[[Callable[[str], bytes | memoryview], list[str]], list[bytes | memoryview]]  # fn over items, in order


def engine_shape(engine: Engine) -> KVShape:
    kv_format, layout = engine.kv_format, engine.kv_layout
    return KVShape(
        fingerprint=kv_format.fingerprint().hex(), model=kv_format.model_fingerprint, weights=kv_format.weights,
        dtype=kv_format.kv_dtype, encoding=kv_format.encoding, layout_version=kv_format.layout_version,
        page_size=layout.page_size, slots=layout.slots, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        page_bytes=engine.kv_page_bytes,
    )


def engine_groups(engine: Engine) -> list[tuple[tuple[int, ...], int | None]]:
    return [(group.layers, group.window) for group in engine.kv_layout.groups]


def check_compatible(manifest: Manifest, engine: Engine) -> KVPolicy:
    """Everything short of reading blobs; returns the snapshot's policy."""
    where = manifest.snapshot_id
    mine = asdict(engine_shape(engine))
    theirs = asdict(manifest.shape)
    differences = [f"{key} {theirs[key]!r} (this server: {mine[key]!r})" for key in mine if theirs[key] != mine[key]]
    if differences:
        raise FailedPreconditionError(
            f"snapshot {where} was taken by another model or KV format: " + "; ".join(differences[:4])
        )
    if [(tuple(g.layers), g.window) for g in manifest.groups] != engine_groups(engine):
        raise FailedPreconditionError(f"snapshot {where} has KV groups that differ from this model's")
    policy = _policy(manifest, engine)
    tokens = list(manifest.token_ids)
    engine.validate_tokens(tokens, f"token ids of snapshot {where}")
    if len(tokens) >= engine.max_model_len:
        raise InvalidArgumentError(f"snapshot {where} holds {len(tokens)} tokens; this server's context is {engine.max_model_len}")
    _check_pages(manifest, policy)
    return policy


def _policy(manifest: Manifest, engine: Engine) -> KVPolicy:
    name, _, sizes = manifest.policy.partition(":")
    sink, _, window = sizes.partition(":")
    try:
        return KVPolicy.create(name, int(sink or 0), int(window or 0), manifest.shape.page_size, engine.max_model_len)
    except (ValueError, InvalidArgumentError) as error:
        raise FailedPreconditionError(f"snapshot {manifest.snapshot_id} uses KV policy {manifest.policy!r}, which this server cannot take: {error}") from error


def _check_pages(manifest: Manifest, policy: KVPolicy) -> None:
    page_size = manifest.shape.page_size
    count = -(-manifest.num_computed // page_size)  # each group's pages (Manifest.from_json checked)
    for index, group in enumerate(manifest.groups):
        for span in policy.readable(group.window, count, manifest.num_computed, page_size):
            if any(group.pages[i] is None for i in span):
                raise FailedPreconditionError(
                    f"snapshot {manifest.snapshot_id}: group {index} lacks pages its next step must read"
                )


def fetch(manifest: Manifest, engine: Engine, store: SnapshotStore, verify: Mapper | None = None) -> KVImage:
    """The verified image of a manifest: raises before anything is loaded if any check fails. `verify`
    maps the blob checks over pages (Persistence passes its thread pool: SHA-256 releases the GIL)."""
    policy = check_compatible(manifest, engine)
    size = engine.kv_page_bytes  # this engine's own page, never what a file claims: bounds each decompression
    digests = manifest.digests()
    stored = store.get_blobs(digests)
    lost = digests - stored.keys()
    if lost:
        raise FailedPreconditionError(f"snapshot {manifest.snapshot_id}: page blob {min(lost)[:16]} is missing")
    order = sorted(stored)
    raws = (verify or _serially)(lambda digest: blobs.decode(stored[digest], digest, size), order)
    pages = {digest: torch.frombuffer(raw if isinstance(raw, bytearray) else bytearray(raw), dtype=torch.uint8)
             for digest, raw in zip(order, raws, strict=True)}
    return KVImage(
        list(manifest.token_ids), manifest.num_computed, policy,
        [[None if d is None else 0 for d in group.pages] for group in manifest.groups],
        {(g, i): pages[d] for g, group in enumerate(manifest.groups) for i, d in enumerate(group.pages) if d is not None},
    )


def _serially(fn: Callable[[str], bytes | memoryview], items: list[str]) -> list[bytes | memoryview]:
    return [fn(item) for item in items]
