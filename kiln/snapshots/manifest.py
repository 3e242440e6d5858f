"""Manifest: what one snapshot is, as JSON. Blobs hold page bytes; the manifest says which blob is which
page of which KV group, and everything a restoring engine must agree with before it may load them.

A manifest names its pages by the SHA-256 of their raw bytes (K and V of every slot of the page, in
PageStorage order), so equal pages are one blob whoever wrote them. `null` marks a page the sequence no
longer held (a sliding-window group released it): it is neither stored nor restored. Owners are kept as
a digest of the API key, never the key itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field

from kiln.errors import FailedPreconditionError, InvalidArgumentError
from kiln.snapshots.blobs import CODEC_ZSTD, CODECS

# Bump when the manifest's fields or their meaning change. 2: `codec` says how this save stored its new
# pages ("raw" or "zstd"; a blob decodes by what it is, blobs.py), and a directory store packs them
# (packs.py). Version 1 manifests (zstd blobs, one file each) are still read.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
KIND_CHECKPOINT = "checkpoint"  # an explicit snapshot (Session.snapshot), restored into a new session
KIND_SESSION = "session"  # a session's own persistence: it comes back under the same id
KINDS = (KIND_CHECKPOINT, KIND_SESSION)
SNAPSHOT_ID = re.compile(r"[A-Za-z0-9_-]{1,160}")  # also a safe file name and Redis key part
DIGEST = re.compile(r"[0-9a-f]{64}")


def owner_digest(owner: str | None) -> str:
    """How a manifest records an owner (an API key, or None in process): a digest, so a store's reader
    learns no key, and equal owners compare equal."""
    return "sha256:" + hashlib.sha256(b"kiln-owner\0" + (owner or "").encode()).hexdigest()[:32]


def check_snapshot_id(snapshot_id: object) -> str:
    if not isinstance(snapshot_id, str) or not SNAPSHOT_ID.fullmatch(snapshot_id):
        shown = repr(snapshot_id)[:64]
        raise InvalidArgumentError(f"snapshot id must be 1-160 characters of [A-Za-z0-9_-], got {shown}", "snapshot_id")
    return snapshot_id


def session_snapshot_id(session_id: str) -> str:
    """The id of a session's own (persistence) snapshot: one per session, replaced by each save."""
    return "session-" + session_id


@dataclass(frozen=True)
class GroupPages:
    """One KV group: its layers (one per slot), its sliding window (None: every key), and the digest of
    each page in position order (None: released)."""

    layers: tuple[int, ...]
    window: int | None
    pages: tuple[str | None, ...]


@dataclass(frozen=True)
class KVShape:
    """Everything that decides the bytes of a page and where they go: checked field by field on restore."""

    fingerprint: str  # KVFormat.fingerprint(), hex: model weights, weight format, KV dtype, encoding, layout
    model: str  # the model's content fingerprint (for messages: which model wrote this)
    weights: str
    dtype: str
    encoding: str
    layout_version: int
    page_size: int
    slots: int
    num_kv_heads: int
    head_dim: int
    page_bytes: int


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    kind: str
    owner: str  # owner_digest of the creator
    session_id: str | None  # the session it was taken of
    created_at: float  # unix seconds
    ttl_s: float  # the session's idle TTL, kept by a restored session
    policy: str  # KVPolicy key: "full", or "sink_window:SINK:WINDOW" / "restore:SINK:WINDOW" (tokens)
    shape: KVShape
    token_ids: tuple[int, ...]
    num_computed: int  # token_ids[:num_computed] have K/V in the pages
    groups: tuple[GroupPages, ...]
    codec: str = CODEC_ZSTD  # how this save stored its new pages (blobs.CODECS)
    format_version: int = FORMAT_VERSION
    session_created_at: float = field(default=0.0)  # when the session (not this snapshot) was created

    def digests(self) -> set[str]:
        return {digest for group in self.groups for digest in group.pages if digest is not None}

    def page_count(self) -> int:
        return sum(digest is not None for group in self.groups for digest in group.pages)

    def to_json(self) -> bytes:
        """Built field by field: dataclasses.asdict would deep-copy every token id and digest (ms at 2k)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        fields["shape"] = asdict(self.shape)
        fields["groups"] = [{"layers": g.layers, "window": g.window, "pages": g.pages} for g in self.groups]
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parses and checks the structure (not yet against an engine); FailedPreconditionError names
        `where` for anything unreadable or from another format version."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise FailedPreconditionError(f"snapshot manifest {where} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise FailedPreconditionError(f"snapshot manifest {where} is not a JSON object")
        if raw.get("format_version") not in READABLE_VERSIONS:
            raise FailedPreconditionError(
                f"snapshot {where} has format version {raw.get('format_version')!r}; this Kiln reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        try:
            manifest = cls(
                **{**raw, "shape": KVShape(**raw["shape"]), "token_ids": tuple(raw["token_ids"]),
                   "groups": tuple(GroupPages(tuple(g["layers"]), g["window"], tuple(g["pages"])) for g in raw["groups"])}
            )
        except (KeyError, TypeError) as error:
            raise FailedPreconditionError(f"snapshot manifest {where} is malformed: {error}") from None
        manifest._check_structure(where)
        return manifest

    def _check_structure(self, where: str) -> None:
        problems = []
        if self.codec not in CODECS:
            problems.append(f"codec {self.codec!r}")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r}")
        if not SNAPSHOT_ID.fullmatch(str(self.snapshot_id)):
            problems.append(f"id {self.snapshot_id!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.token_ids):
            problems.append("token ids are not all integers")
        if not isinstance(self.num_computed, int) or not 0 <= self.num_computed <= len(self.token_ids):
            problems.append(f"{self.num_computed!r} computed tokens of {len(self.token_ids)}")
        if any(d is not None and not (isinstance(d, str) and DIGEST.fullmatch(d)) for g in self.groups for d in g.pages):
            problems.append("a page digest is not 64 hex digits")
        if problems:
            raise FailedPreconditionError(f"snapshot manifest {where} is malformed: " + "; ".join(problems))
