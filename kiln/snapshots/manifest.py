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
import math
import re
import reprlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

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
OWNER = re.compile(r"sha256:[0-9a-f]{1,64}")
SESSION_PREFIX = "session-"  # a session's own snapshot is SESSION_PREFIX + its id; no other snapshot's id starts so
# Bounds of what a manifest may claim, far above any real model's, checked before anything is sized by them.
MAX_MANIFEST_BYTES = 32 * 2**20  # the JSON: a history of millions of tokens fits
MAX_PAGE_BYTES = 256 * 2**20  # one page (real ones: KiB to a few MiB); also bounds a blob's decompression
MAX_DIMENSION = 2**16  # page size, slots, KV heads, head dim, layer index, layout version
MAX_GROUPS = 4096
MAX_TOKEN_ID = 2**31 - 1  # the vocabulary itself is checked on restore
MAX_NAME_CHARS = 256  # model, weights, dtype, encoding
MAX_POLICY_CHARS = 64
_REQUIRED = object()  # a field without a default


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
    return SESSION_PREFIX + session_id


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
        """Parses and checks every field for type and range, and what the file claims about sizes against
        what its shape implies (not yet against an engine): import, restore, revival, listing and gc all
        read manifests here. FailedPreconditionError names `where` and each problem found."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise FailedPreconditionError(f"snapshot manifest {where} is {len(data)} bytes; a manifest is at most "
                                          f"{MAX_MANIFEST_BYTES} bytes")
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise FailedPreconditionError(f"snapshot manifest {where} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise FailedPreconditionError(f"snapshot manifest {where} is not a JSON object")
        version = raw.get("format_version")
        if not _is_int(version) or version not in READABLE_VERSIONS:
            raise FailedPreconditionError(
                f"snapshot {where} has format version {_shown(version)}; this Kiln reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        return _parse(raw, where)


def _parse(raw: dict, where: str) -> Manifest:
    """The one manifest validator (see Manifest.from_json)."""
    fields = _Fields(raw, "")
    shape = _parse_shape(fields.get("shape", lambda v: isinstance(v, dict), "an object"), fields)
    tokens = fields.get("token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in v),
                        f"a list of token ids in [0, {MAX_TOKEN_ID}]")
    manifest_fields = {
        "snapshot_id": fields.get("snapshot_id", _matches(SNAPSHOT_ID), "1-160 characters of [A-Za-z0-9_-]"),
        "kind": fields.get("kind", lambda v: v in KINDS, f"one of {list(KINDS)}"),
        "owner": fields.get("owner", _matches(OWNER), "an owner digest (sha256:HEX)"),
        "session_id": fields.get("session_id", lambda v: v is None or _matches(SNAPSHOT_ID)(v), "a session id or null"),
        "created_at": fields.get("created_at", _is_instant, "unix seconds"),
        "ttl_s": fields.get("ttl_s", lambda v: _is_number(v) and v > 0, "a positive finite number of seconds"),
        "policy": fields.get("policy", lambda v: isinstance(v, str) and len(v) <= MAX_POLICY_CHARS, "a KV policy key"),
        "num_computed": fields.get("num_computed", lambda v: _is_int(v) and 0 <= v <= len(tokens or ()),
                                   "a count of the token ids"),
        "codec": fields.get("codec", lambda v: v in CODECS, f"one of {list(CODECS)}", CODEC_ZSTD),
        "session_created_at": fields.get("session_created_at", _is_instant, "unix seconds", 0.0),
        "format_version": fields.get("format_version", _is_int, "an integer"),  # its value checked by the caller
    }
    groups = fields.get("groups", lambda v: isinstance(v, list) and 0 < len(v) <= MAX_GROUPS, f"a list of 1-{MAX_GROUPS} KV groups")
    fields.check_known()
    if fields.problems:
        raise FailedPreconditionError(f"snapshot manifest {where} is malformed: " + "; ".join(fields.problems[:8]))
    assert shape is not None and groups is not None
    computed = manifest_fields["num_computed"]
    parsed = tuple(_parse_group(group, index, shape.slots, fields) for index, group in enumerate(groups))
    expected = -(-computed // shape.page_size)
    for index, group in enumerate(parsed):
        if len(group.pages) != expected:
            fields.problems.append(f"group {index} lists {len(group.pages)} pages for {computed} computed tokens "
                                   f"(expected {expected})")
    snapshot_id, session_id = manifest_fields["snapshot_id"], manifest_fields["session_id"]
    if (manifest_fields["kind"] == KIND_SESSION) != snapshot_id.startswith(SESSION_PREFIX) or (
            manifest_fields["kind"] == KIND_SESSION and snapshot_id != session_snapshot_id(session_id or "")):
        fields.problems.append(f"a {manifest_fields['kind']} snapshot with id {snapshot_id!r} of session {session_id!r} "
                               f"(a session's own snapshot is {SESSION_PREFIX}<its id>, and only it)")
    if fields.problems:
        raise FailedPreconditionError(f"snapshot manifest {where} is malformed: " + "; ".join(fields.problems[:8]))
    return Manifest(**manifest_fields, shape=shape, token_ids=tuple(tokens), groups=parsed)


def _parse_shape(raw: dict | None, parent: _Fields) -> KVShape | None:
    """A KVShape whose page_bytes is what its other fields imply (kiln/kv/codec.py), and at most
    MAX_PAGE_BYTES: a file's claim about the size of its pages is never trusted by itself."""
    if raw is None:
        return None
    fields = _Fields(raw, "shape.", parent.problems)
    dimension = (lambda v: _is_int(v) and 0 < v <= MAX_DIMENSION, f"an integer in [1, {MAX_DIMENSION}]")
    shape = KVShape(
        fingerprint=fields.get("fingerprint", _matches(DIGEST), "64 hex digits"),
        **{name: fields.get(name, lambda v: isinstance(v, str) and 0 < len(v) <= MAX_NAME_CHARS, "a name")
           for name in ("model", "weights", "dtype", "encoding")},
        **{name: fields.get(name, *dimension) for name in ("layout_version", "page_size", "slots", "num_kv_heads", "head_dim")},
        page_bytes=fields.get("page_bytes", lambda v: _is_int(v) and 0 < v <= MAX_PAGE_BYTES, f"a size in [1, {MAX_PAGE_BYTES}]"),
    )
    fields.check_known()
    if any(value is None for value in asdict(shape).values()):
        return None
    implied = _implied_page_bytes(shape)
    if implied != shape.page_bytes:
        parent.problems.append(f"shape.page_bytes {shape.page_bytes} is not what the shape implies "
                               f"({'an unknown dtype or encoding' if implied is None else implied})")
        return None
    return shape


def _implied_page_bytes(shape: KVShape) -> int | None:
    """Bytes of a page of this shape as the KV codec lays it out; None for a dtype or encoding it lacks.
    Imported here: the snapshot commands and the crash-test writer read manifests without torch otherwise."""
    import torch

    from kiln.kv.codec import CODECS as KV_CODECS
    from kiln.kv.codec import KVCodec
    from kiln.kv.layout import KVLayout

    dtype = getattr(torch, shape.dtype, None)
    codec = "none" if shape.encoding == "raw" else shape.encoding  # KVCodec.encoding's inverse
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or codec not in KV_CODECS or shape.encoding == "none":
        return None
    layout = KVLayout((), shape.slots, shape.page_size, shape.num_kv_heads, shape.head_dim)
    return KVCodec(codec, layout, dtype).page_nbytes


def _parse_group(raw: object, index: int, slots: int, parent: _Fields) -> GroupPages:
    """A group of `slots` layers and its pages (a digest each, or null: released)."""
    fields = _Fields(raw if isinstance(raw, dict) else {}, f"groups[{index}].", parent.problems)
    layers = fields.get("layers", lambda v: isinstance(v, list) and len(v) == slots and all(_is_int(x) and 0 <= x <= MAX_DIMENSION for x in v),
                        f"a list of {slots} layer indexes")
    window = fields.get("window", lambda v: v is None or (_is_int(v) and v > 0), "a positive window or null")
    digests = fields.get("pages", lambda v: isinstance(v, list) and all(d is None or _matches(DIGEST)(d) for d in v),
                         "a list of page digests (64 hex digits) or nulls")
    fields.check_known()
    return GroupPages(tuple(layers or ()), window, tuple(digests or ()))


class _Fields:
    """A JSON object's fields read by type and range; every problem is collected (one message names all)."""

    def __init__(self, raw: dict, prefix: str, problems: list[str] | None = None) -> None:
        self.raw, self.prefix = raw, prefix
        self.problems = [] if problems is None else problems
        self.read: set[str] = set()

    def get(self, name: str, test: Callable[[Any], bool], expected: str, default: Any = _REQUIRED) -> Any:
        self.read.add(name)
        if name not in self.raw:
            if default is _REQUIRED:
                self.problems.append(f"no {self.prefix}{name}")
                return None
            return default
        value = self.raw[name]
        if not test(value):
            self.problems.append(f"{self.prefix}{name} {_shown(value)} is not {expected}")
            return None
        return value

    def check_known(self) -> None:
        unknown = sorted(str(name) for name in self.raw.keys() - self.read)
        if unknown:
            self.problems.append(f"unknown field(s) {self.prefix}{', '.join(unknown)[:80]}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_instant(value: object) -> bool:
    return _is_number(value) and value >= 0


def _matches(pattern: re.Pattern[str]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, str) and pattern.fullmatch(value) is not None


def _shown(value: object) -> str:
    """A field's value as a message quotes it: never kilobytes of it (nor the time to write them)."""
    return reprlib.repr(value)
