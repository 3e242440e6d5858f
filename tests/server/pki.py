"""A throwaway PKI for the TLS tests (tests/server/test_tls.py, the TypeScript SDK's test/tls.test.ts):
PEM files written by trustme, made afresh for each run so no key outlives it."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import trustme
from cryptography.hazmat.primitives import serialization


@dataclass(frozen=True)
class Pki:
    """Paths of PEM files: the server's CA and certificate (for localhost and 127.0.0.1), a CA nobody
    uses, the client CA with a client certificate it signed, a client certificate signed by the other
    CA (a stranger's), an encrypted copy of the server's key, and a file that is no PEM at all."""

    ca: Path
    server_cert: Path
    server_key: Path
    other_ca: Path
    client_ca: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path
    encrypted_key: Path
    junk: Path

    def paths(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


def write_pki(root: Path) -> Pki:
    """A new PKI's files under `root` (which must exist)."""
    server_ca, other_ca, client_ca = trustme.CA(), trustme.CA(), trustme.CA()
    pki = Pki(**{f.name: root / f"{f.name}.pem" for f in fields(Pki)})
    server = server_ca.issue_cert("localhost", "127.0.0.1")
    client, stranger = client_ca.issue_cert("agent@kiln.test"), other_ca.issue_cert("agent@kiln.test")
    for path, blob in [(pki.ca, server_ca.cert_pem), (pki.other_ca, other_ca.cert_pem), (pki.client_ca, client_ca.cert_pem),
                       (pki.server_key, server.private_key_pem), (pki.client_key, client.private_key_pem),
                       (pki.stranger_key, stranger.private_key_pem)]:
        blob.write_to_path(path)
    for path, cert in [(pki.server_cert, server), (pki.client_cert, client), (pki.stranger_cert, stranger)]:
        path.write_bytes(b"".join(pem.bytes() for pem in cert.cert_chain_pems))
    pki.encrypted_key.write_bytes(_encrypted(server.private_key_pem.bytes()))
    pki.junk.write_text("not a PEM file\n")
    return pki


def _encrypted(key_pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(key_pem, password=None)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(b"passphrase"))
