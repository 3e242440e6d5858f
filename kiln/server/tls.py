"""TLS for `kiln serve`: one certificate and key serve both ports (gRPC and HTTP), and an optional client
CA makes both ports demand a client certificate signed by it (mutual TLS).

What each setting protects (docs/architecture.md § Security):
- `--tls-cert` / `--tls-key`: the traffic is encrypted and the client knows it talks to the holder of the
  key. It says nothing about who the client is: TLS without API keys on a LAN encrypts but does not
  authenticate, so any host that can reach the port can use the server. That is why TLS does not lift
  the rule that a non-loopback bind needs an API key (or --insecure-no-auth).
- `--tls-client-ca`: only clients holding a certificate signed by that CA complete the handshake, on
  either port; API keys, when set, are still checked on top (they scope sessions to their owner).

The files are read and checked when the options are built (kiln/pem.py), before the model loads, so a
bad flag costs nothing: `kiln serve` exits 2 naming the file and the problem. uvicorn reads the same
paths again when it binds the HTTP port.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any

import grpc

from kiln import pem
from kiln.errors import InvalidArgumentError


@dataclass(frozen=True)
class TlsSettings:
    """A checked certificate chain and key (and client CA, for mutual TLS), with the PEM bytes gRPC takes."""

    cert_file: str
    key_file: str
    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    client_ca_file: str | None = None
    client_ca: bytes | None = field(default=None, repr=False)

    @classmethod
    def from_flags(cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None) -> TlsSettings | None:
        """None when no TLS flag is given; InvalidArgumentError for an incomplete set of flags or a file
        that cannot serve (unreadable, not PEM, encrypted key, key not the certificate's)."""
        if cert_file is None and key_file is None:
            if client_ca_file is not None:
                raise InvalidArgumentError("--tls-client-ca needs --tls-cert and --tls-key (the server's own certificate)")
            return None
        if cert_file is None or key_file is None:
            given, missing = ("--tls-cert", "--tls-key") if key_file is None else ("--tls-key", "--tls-cert")
            raise InvalidArgumentError(f"{given} needs {missing}")
        chain, key = pem.key_pair("--tls-cert", cert_file, "--tls-key", key_file)
        client_ca = None if client_ca_file is None else pem.certificates("--tls-client-ca", client_ca_file)
        return cls(cert_file, key_file, chain, key, client_ca_file, client_ca)

    @property
    def client_auth(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_auth)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's TLS arguments."""
        kwargs: dict[str, Any] = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.client_ca_file is not None:
            kwargs |= {"ssl_ca_certs": self.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return kwargs

    def describe(self) -> str:
        """How the ready line names the transport security."""
        return "TLS, client certificates required" if self.client_auth else "TLS"
