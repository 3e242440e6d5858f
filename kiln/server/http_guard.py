"""Which web pages may drive the HTTP API: the Host check against DNS rebinding, the Origin check
against cross-site requests, and CORS for the origins an operator names.

A server on 127.0.0.1 without keys is reachable from every page the user's browser opens. Two ways in:
- DNS rebinding: a page on evil.example re-points its name at 127.0.0.1, and the browser sends the
  page's requests to Kiln as same-origin requests for `Host: evil.example`, reading the answers. The
  guard answers any request whose Host (port aside) is not one of this server's names with 421, before
  authentication (an attacker learns nothing, not even whether keys are on). The names: localhost,
  127.0.0.1, [::1], the bound address when `--host` is a specific one, and each `--allowed-host`; a
  server bound to 0.0.0.0 or :: is reached by names only its operator knows, so they must be listed.
  `--allowed-host '*'` turns the check off: unsafe unless something in front of Kiln checks Host.
- Cross-site requests: a page may send a "simple" request (a form-like POST) to http://127.0.0.1
  without asking; it cannot read the answer, but the request runs. Browsers mark every such request
  with `Origin`, which API clients (SDKs, curl) do not send: a request whose Origin is neither one of
  `--cors-origin` nor this server itself (same scheme-less authority as an allowed Host) is refused
  with 403.
With `--cors-origin` the named origins (and only they) get CORS answers, so their pages can call the
API; without it no response carries any Access-Control-* header. Refusals never echo the Host or
Origin they refused. `/healthz` and `/health` are exempt from both checks: load balancers probe them by IP
address, and they tell no more than whether the server is up; `/metrics` is not exempt.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.errors import InvalidArgumentError
from kiln.server.http_errors import envelope

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
ANY_HOST = "*"
OPEN_PATHS = frozenset({"/healthz", "/health"})
CORS_METHODS = ("GET", "POST", "DELETE")
CORS_HEADERS = ("authorization", "content-type", "x-request-id")
CORS_EXPOSED = ("x-request-id", "kiln-ignored-fields")  # the second: kiln/server/http_models.py IGNORED_FIELDS_HEADER
CORS_MAX_AGE_S = 600
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_PORT = re.compile(r"[0-9]{1,5}")


def host_name(value: str) -> str | None:
    """The host of a Host header or an authority, lower case, IPv6 in brackets, port dropped; None if it
    is not a well-formed host."""
    value = value.strip().lower()
    if value.startswith("["):
        address, bracket, port = value[1:].partition("]")
        if not bracket or (port and not (port.startswith(":") and _PORT.fullmatch(port[1:]))):
            return None
        return f"[{address}]" if _is_ipv6(address) else None
    name, colon, port = value.partition(":")
    if colon and not _PORT.fullmatch(port):
        return None
    return name if _NAME.fullmatch(name) else None


def _is_ipv6(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv6Address)
    except ValueError:
        return False


def _allowed_name(value: str) -> str:
    """An `--allowed-host` value as the guard compares it: a name or address, without a port."""
    text = value.strip().lower()
    if _is_ipv6(text):
        text = f"[{text}]"
    name = host_name(text)
    if name is None:
        raise InvalidArgumentError(f"--allowed-host {value!r} is not a host name or address")
    if name != text:
        raise InvalidArgumentError(f"--allowed-host {value!r}: give the name without a port (any port is accepted)")
    return name


def _origin(value: str) -> str:
    """A `--cors-origin` value as browsers send it: scheme://host[:port], nothing else."""
    text = value.strip().lower()
    if text == ANY_HOST:
        raise InvalidArgumentError("--cors-origin '*' would let every web page call the API: name the origins")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc or "@" in parts.netloc \
            or parts.path or parts.query or parts.fragment or host_name(parts.netloc) is None:
        raise InvalidArgumentError(
            f"--cors-origin {value!r} is not an origin: scheme://host[:port], no path or trailing slash "
            "(e.g. https://app.example.com)")
    return text


@dataclass(frozen=True)
class HttpGuard:
    """The Host names and the cross-origin pages the HTTP API answers. `any_host`: no Host check."""

    hosts: frozenset[str]
    cors_origins: tuple[str, ...] = ()
    any_host: bool = False

    @classmethod
    def for_bind(cls, bind_host: str, allowed_hosts: Sequence[str] = (), cors_origins: Sequence[str] = ()) -> HttpGuard:
        """The guard of a server bound to `bind_host`; raises InvalidArgumentError for a value that is
        not a host name or an origin."""
        any_host = ANY_HOST in (value.strip() for value in allowed_hosts)
        names = {_allowed_name(value) for value in allowed_hosts if value.strip() != ANY_HOST}
        names.update(LOOPBACK_NAMES)
        if not cls.wildcard(bind_host):
            names.add(_allowed_name(bind_host))
        return cls(frozenset(names), tuple(dict.fromkeys(_origin(origin) for origin in cors_origins)), any_host)

    @staticmethod
    def wildcard(bind_host: str) -> bool:
        """Whether a bind address listens on every interface (the names it is reached by are unknown)."""
        try:
            return ipaddress.ip_address(bind_host).is_unspecified
        except ValueError:
            return False

    def allows_host(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """Exactly one Host header, naming this server (a request without one, as HTTP/1.0 allows, is
        refused: nothing says whom it is for)."""
        if self.any_host:
            return True
        hosts = [value for name, value in headers if name == b"host"]
        return len(hosts) == 1 and host_name(hosts[0].decode("latin-1")) in self.hosts

    def allows_origin(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        """No Origin (not a browser), a named CORS origin, or this server itself."""
        origins = [value.decode("latin-1").strip().lower() for name, value in headers if name == b"origin"]
        if not origins:
            return True
        if len(origins) > 1:
            return False
        if origins[0] in self.cors_origins:
            return True
        parts = urlsplit(origins[0])
        own = [value.decode("latin-1").strip().lower() for name, value in headers if name == b"host"]
        return parts.scheme in ("http", "https") and own == [parts.netloc] and self.allows_host(headers)

    def install(self, app: FastAPI) -> None:
        """Adds CORS (only for named origins) and, outside it, the guard: call after the middleware that
        must run after the checks (authentication) and before what must see every request (metrics)."""
        if self.cors_origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(self.cors_origins), allow_methods=list(CORS_METHODS),
                               allow_headers=list(CORS_HEADERS), expose_headers=list(CORS_EXPOSED),
                               allow_credentials=False, max_age=CORS_MAX_AGE_S)
        app.add_middleware(HttpGuardMiddleware, guard=self)


MISDIRECTED = ("this server does not answer to that Host name (a protection against DNS rebinding); its operator "
               "can add names with `kiln serve --allowed-host NAME`")
CROSS_SITE = ("requests from web pages are refused unless their origin is named with `kiln serve --cors-origin "
              "ORIGIN`")


class HttpGuardMiddleware:
    """421 for a Host that is not this server's, then 403 for an unnamed web page's Origin."""

    def __init__(self, app: ASGIApp, guard: HttpGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif not self.guard.allows_host(scope["headers"]):
            await JSONResponse(envelope(MISDIRECTED, "INVALID_ARGUMENT"), status_code=421)(scope, receive, send)
        elif not self.guard.allows_origin(scope["headers"]):
            await JSONResponse(envelope(CROSS_SITE, "PERMISSION_DENIED"), status_code=403)(scope, receive, send)
        else:
            await self.app(scope, receive, send)
