"""API keys: which callers may use the server, and the identity that scopes their sessions.

Keys come from --api-key (repeatable), --api-keys-file (one per line, # comments) or KILN_API_KEY. A
caller's identity is a digest of its key, so sessions never store the key itself; with no keys
configured every caller is the same anonymous identity (None)."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from kiln.errors import InvalidArgumentError, UnauthenticatedError

ENV_VAR = "KILN_API_KEY"


class ApiKeys:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._keys = [k for k in (key.strip() for key in keys) if k]

    @classmethod
    def from_sources(cls, keys: Iterable[str] = (), keys_file: str | None = None, env: dict | None = None) -> ApiKeys:
        collected = list(keys)
        if keys_file:
            try:
                lines = Path(keys_file).read_text().splitlines()
            except OSError as error:
                raise InvalidArgumentError(f"cannot read API keys file {keys_file}: {error}") from None
            collected += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        env_key = (os.environ if env is None else env).get(ENV_VAR)
        if env_key:
            collected.append(env_key)
        return cls(collected)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def identify(self, authorization: str | None) -> str | None:
        """The caller's identity from an `Authorization: Bearer <key>` value; None when auth is off.
        Raises UnauthenticatedError for a missing, malformed or unknown key."""
        if not self._keys:
            return None
        if not authorization:
            raise UnauthenticatedError("missing API key: send 'authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise UnauthenticatedError("malformed authorization: expected 'Bearer <key>'")
        key = key.strip()
        if not any(hmac.compare_digest(key.encode(), known.encode()) for known in self._keys):
            raise UnauthenticatedError("unknown API key")
        return hashlib.sha256(key.encode()).hexdigest()[:32]
