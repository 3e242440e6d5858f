"""The gRPC channel of both Python clients (sync.Client and aio.AsyncClient), plaintext or TLS.

TLS is on when asked for (`tls=True`: the system's trusted roots) or implied by a file: `ca_file` trusts
that CA (a self-signed or private CA) instead of the system's roots, and `cert_file` + `key_file`
present a client certificate, for a server started with --tls-client-ca. The files are read and checked
when the client is created (kiln/pem.py), so a wrong path or a key that is not the certificate's own is
an InvalidArgumentError naming it then, not an UNAVAILABLE on the first call. The server's certificate
must name the host of `address` (a DNS name or an IP address in its subjectAltName).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import grpc.aio

from kiln import pem
from kiln.errors import InvalidArgumentError


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client's channel is secured: None everywhere with `tls` False is plaintext."""

    tls: bool = False
    root_certificates: bytes | None = field(default=None, repr=False)  # None: the system's roots
    certificate_chain: bytes | None = field(default=None, repr=False)  # the client's, for mutual TLS
    private_key: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_options(cls, tls: bool = False, ca_file: str | None = None, cert_file: str | None = None,
                     key_file: str | None = None) -> ChannelSecurity:
        """The clients' keyword arguments, checked: a client certificate needs both files, and any file
        implies TLS."""
        if not isinstance(tls, bool):
            raise InvalidArgumentError(f"tls must be True or False, got {tls!r:.80}")
        if (cert_file is None) != (key_file is None):
            given, missing = ("cert_file", "key_file") if key_file is None else ("key_file", "cert_file")
            raise InvalidArgumentError(f"{given} needs {missing} (a client certificate and its private key)")
        roots = None if ca_file is None else pem.certificates("ca_file", ca_file)
        chain, key = (None, None) if cert_file is None else pem.key_pair("cert_file", cert_file, "key_file", key_file)
        return cls(tls or ca_file is not None or cert_file is not None, roots, chain, key)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def open_channel(address: str, security: ChannelSecurity, aio: bool = False) -> grpc.Channel | grpc.aio.Channel:
    """A channel to `address`: blocking, or for asyncio with `aio` (create that one on the loop that uses it)."""
    api = grpc.aio if aio else grpc
    if security.tls:
        return api.secure_channel(address, security.credentials())
    return api.insecure_channel(address)
