"""PEM files for TLS, read and checked the same way by `kiln serve` (kiln/server/tls.py) and the Python
SDK (kiln/client/channel.py).

gRPC takes certificates and keys as bytes and finds out what is wrong with them only when it binds a
port or opens a connection, with a message that names neither the file nor the problem. So every file is
read and checked here first, with the standard library's OpenSSL: a file that cannot be read, holds no
certificate, holds no (or an encrypted) private key, or a key that is not the certificate's own is an
InvalidArgumentError naming the file (by `what`, the flag or parameter that gave it, and its path) and
the problem. Passphrase-protected keys are refused rather than prompted for: a server must start
unattended.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from kiln.errors import InvalidArgumentError

PRIVATE_KEY_MARKER = b"PRIVATE KEY-----"
ENCRYPTED_MARKERS = (b"ENCRYPTED PRIVATE KEY-----", b"Proc-Type: 4,ENCRYPTED")


def read_pem(what: str, path: str | Path) -> bytes:
    """The bytes of `path`; InvalidArgumentError when it cannot be read (missing, a directory, no access)."""
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise InvalidArgumentError(f"cannot read {what} {path}: {error.strerror or error}") from None


def certificates(what: str, path: str | Path) -> bytes:
    """The PEM bytes of `path`, which must hold at least one certificate (a CA bundle, a chain)."""
    pem = read_pem(what, path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=pem.decode("latin-1"))
    except ssl.SSLError:
        raise InvalidArgumentError(f"{what} {path} holds no PEM certificate") from None
    return pem


def private_key(what: str, path: str | Path) -> bytes:
    """The PEM bytes of `path`, which must hold an unencrypted private key."""
    pem = read_pem(what, path)
    if any(marker in pem for marker in ENCRYPTED_MARKERS):
        raise InvalidArgumentError(f"{what} {path} is encrypted (passphrase-protected): give an unencrypted key")
    if PRIVATE_KEY_MARKER not in pem:
        raise InvalidArgumentError(f"{what} {path} holds no PEM private key")
    return pem


def key_pair(cert_what: str, cert_path: str | Path, key_what: str, key_path: str | Path) -> tuple[bytes, bytes]:
    """(certificate chain, private key) PEM bytes, checked to belong together."""
    chain, key = certificates(cert_what, cert_path), private_key(key_what, key_path)
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=_no_passphrase)
    except ssl.SSLError as error:
        if "KEY_VALUES_MISMATCH" in str(error):
            raise InvalidArgumentError(
                f"{key_what} {key_path} does not match the certificate in {cert_what} {cert_path}") from None
        raise InvalidArgumentError(
            f"cannot load {cert_what} {cert_path} with {key_what} {key_path}: {error.reason or error}") from None
    return chain, key


def _no_passphrase() -> bytes:
    """What load_cert_chain gets instead of prompting on the terminal (encrypted keys are refused before)."""
    return b""
