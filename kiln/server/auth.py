"""API keys: which callers may use the server, the identity that scopes their sessions, and their limits.

Keys come from --api-key (repeatable), KILN_API_KEY and --api-keys-file, which is either one key per
line (# comments) or, when its name ends in `.toml` or its first line that is not blank or a comment
opens a table (`[`), TOML:

    [keys.alice]
    key_sha256 = "<64 hex digits: sha256 of the key>"   # or key = "...", accepted with a warning
    max_sessions = 8                # optional limits, kiln/server/quotas.py
    max_resident_kv_bytes = "512MiB"
    max_concurrent_generations = 2
    tokens_per_minute = 20000
    admin = true                    # the dashboard shows this key every key's sessions

In memory a key is only its SHA-256 digest; a presented key is hashed and compared digest against digest
with hmac.compare_digest. A caller's identity is the first 32 hex digits of that digest: the same for a
key however it was configured, so sessions and snapshots (which store the identity as their owner)
survive restarts and `reload()`. With no keys configured every caller is the anonymous identity None.

The header is parsed strictly (RFC 6750 § 2.1): `Bearer`, one space, a b64token (letters, digits,
`-._~+/`, then `=` padding), nothing else; the scheme is case-insensitive (RFC 7235 § 2.1). Failed
attempts are counted per peer address and throttled (kiln/server/auth_failures.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kiln.errors import InvalidArgumentError, UnauthenticatedError
from kiln.server.auth_failures import AuthFailures
from kiln.server.quotas import Limits

logger = logging.getLogger(__name__)

ENV_VAR = "KILN_API_KEY"
IDENTITY_HEX_DIGITS = 32
B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_HEADER = re.compile(r"(?i:bearer) (" + B64TOKEN.pattern + r")")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_ENTRY_FIELDS = frozenset({"key", "key_sha256", "admin"})


@dataclass(frozen=True)
class KeyEntry:
    """One accepted key: its SHA-256 digest (hex), a name for logs, its limits, the admin flag."""

    name: str
    digest: str
    limits: Limits = field(default_factory=Limits)
    admin: bool = False

    @property
    def identity(self) -> str:
        return self.digest[:IDENTITY_HEX_DIGITS]


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def identity_of(key: str) -> str:
    """The owner identity a key's sessions carry."""
    return digest_of(key)[:IDENTITY_HEX_DIGITS]


class ApiKeys:
    """The accepted keys, replaced as a whole by `reload()` (one reference swap: a concurrent call sees
    the old set or the new one, never a mix)."""

    def __init__(self, keys: Iterable[str] = (), keys_file: str | None = None, failures: AuthFailures | None = None) -> None:
        self._fixed = tuple(_plain_entry(key, f"key {index + 1}") for index, key in enumerate(_stripped(keys)))
        self._file = keys_file
        self.failures = failures or AuthFailures()
        self._keys = _index(self._fixed + (read_keys_file(keys_file) if keys_file else ()))  # identity -> entry

    @classmethod
    def from_sources(cls, keys: Iterable[str] = (), keys_file: str | None = None, env: dict | None = None,
                     failures: AuthFailures | None = None) -> ApiKeys:
        env_key = (os.environ if env is None else env).get(ENV_VAR)
        return cls([*keys, *([env_key] if env_key else [])], keys_file, failures)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    @property
    def entries(self) -> tuple[KeyEntry, ...]:
        return tuple(self._keys.values())

    def reload(self) -> int:
        """Re-read the keys file (SIGHUP): the keys of --api-key / KILN_API_KEY plus the file's new ones
        replace the old set at once; returns how many keys are accepted now. A file that cannot be read
        or parsed, or that would leave no key at all (turning authentication off), raises
        InvalidArgumentError and changes nothing."""
        if self._file is None:
            raise InvalidArgumentError("no --api-keys-file to reload")
        keys = _index(self._fixed + read_keys_file(self._file))
        if not keys and self._keys:
            raise InvalidArgumentError(f"{self._file} holds no key: reloading it would turn authentication off")
        self._keys = keys  # one swap
        return len(keys)

    def limits(self, identity: str | None) -> Limits:
        """The limits of a caller (none for the anonymous caller or a key removed since it called)."""
        entry = self._keys.get(identity) if identity is not None else None
        return entry.limits if entry is not None else Limits()

    def sees_all(self, identity: str | None) -> bool:
        """Whether this caller may see every owner's sessions on the dashboard: an admin key, or anyone
        when auth is off (every session is then the anonymous caller's)."""
        if not self._keys:
            return True
        entry = self._keys.get(identity) if identity is not None else None
        return entry is not None and entry.admin

    def routing_identity(self, authorization: str | None) -> tuple[bool, str | None]:
        """(accepted, identity) as `identify` would decide, without throttling or counting a failure: for
        routing a request before the server it reaches authenticates it (kiln/fleet/front.py)."""
        entries = tuple(self._keys.values())
        if not entries:
            return True, None
        try:
            return True, _match(entries, authorization).identity
        except UnauthenticatedError:
            return False, None

    def identify(self, authorization: str | None, peer: str | None = None) -> str | None:
        """The caller's identity from an `Authorization` value; None when auth is off. Raises
        UnauthenticatedError for a missing, malformed or unknown key, and, without looking at the key,
        for a `peer` address throttled after repeated failures (AuthThrottledError, with a retry delay)."""
        entries = tuple(self._keys.values())
        if not entries:
            return None
        self.failures.check(peer)
        try:
            return _match(entries, authorization).identity
        except UnauthenticatedError:
            self.failures.record(peer)
            raise


def _match(entries: tuple[KeyEntry, ...], authorization: str | None) -> KeyEntry:
    if not authorization:
        raise UnauthenticatedError("missing API key: send 'authorization: Bearer <key>'")
    parsed = _HEADER.fullmatch(authorization)
    if parsed is None:
        raise UnauthenticatedError("malformed authorization: expected 'Bearer <key>' (one space, no other whitespace)")
    presented = digest_of(parsed.group(1)).encode()
    found = None
    for entry in entries:  # every entry compared: the time taken does not depend on which one matched
        if hmac.compare_digest(presented, entry.digest.encode()):
            found = entry
    if found is None:
        raise UnauthenticatedError("unknown API key")
    return found


def _index(entries: tuple[KeyEntry, ...]) -> Mapping[str, KeyEntry]:
    by_identity: dict[str, KeyEntry] = {}
    for entry in entries:
        other = by_identity.setdefault(entry.identity, entry)
        if (other.limits, other.admin) != (entry.limits, entry.admin):
            raise InvalidArgumentError(f"API keys {other.name!r} and {entry.name!r} are the same key with different settings")
    return by_identity


def _stripped(keys: Iterable[str]) -> list[str]:
    return [k for k in (key.strip() for key in keys) if k]


def _plain_entry(key: str, name: str) -> KeyEntry:
    if not B64TOKEN.fullmatch(key):
        raise InvalidArgumentError(f"API key {name} has characters a bearer token cannot carry "
                                   "(allowed: letters, digits, - . _ ~ + / and trailing =)")
    return KeyEntry(name, digest_of(key))


# ---- the keys file -------------------------------------------------------------------------------

def read_keys_file(path: str) -> tuple[KeyEntry, ...]:
    """The keys of a file in either format (see the module docstring); InvalidArgumentError naming the
    file and the fault for anything unreadable or malformed (never quoting a key)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise InvalidArgumentError(f"cannot read API keys file {path}: {error}") from None
    lines = [line.strip() for line in text.splitlines()]
    content = [line for line in lines if line and not line.startswith("#")]
    if path.endswith(".toml") or (content and content[0].startswith("[")):
        return _toml_entries(path, text)
    return tuple(_plain_entry(line, f"on line {lines.index(line) + 1} of {path}") for line in content)


def _toml_entries(path: str, text: str) -> tuple[KeyEntry, ...]:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise InvalidArgumentError(f"API keys file {path} is not valid TOML: {error}") from None
    extra = set(document) - {"keys"}
    if extra:
        raise InvalidArgumentError(f"API keys file {path}: unknown top-level entries {sorted(extra)} (only [keys.<name>])")
    tables = document.get("keys", {})
    if not isinstance(tables, dict) or not all(isinstance(table, dict) for table in tables.values()):
        raise InvalidArgumentError(f"API keys file {path}: every key is a table [keys.<name>]")
    return tuple(_toml_entry(f"keys.{name} in {path}", name, table) for name, table in tables.items())


def _toml_entry(where: str, name: str, table: dict) -> KeyEntry:
    unknown = set(table) - _ENTRY_FIELDS - Limits.FIELDS
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown fields {sorted(unknown)}")
    if ("key" in table) == ("key_sha256" in table):
        raise InvalidArgumentError(f"{where}: give exactly one of key_sha256 (preferred) or key")
    if "key" in table:
        key = table["key"]
        if not isinstance(key, str) or not B64TOKEN.fullmatch(key):
            raise InvalidArgumentError(f"{where}: key must be a bearer token (letters, digits, - . _ ~ + / and trailing =)")
        logger.warning("%s holds a plaintext key: store key_sha256 = sha256(key) instead", where)
        digest = digest_of(key)
    else:
        digest = table["key_sha256"]
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest.lower()):
            raise InvalidArgumentError(f"{where}: key_sha256 must be 64 hexadecimal digits")
        digest = digest.lower()
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise InvalidArgumentError(f"{where}: admin must be true or false")
    return KeyEntry(name, digest, Limits.from_table(table, where), admin)
