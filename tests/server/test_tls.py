"""TLS on both ports of `kiln serve` (--tls-cert/--tls-key, --tls-client-ca) and in the Python SDK, against
a throwaway PKI made here with trustme: what a client that trusts the server's CA gets, and that a
plaintext client, a client trusting another CA, and (with client auth) a client without a certificate
signed by the client CA are refused on both ports, without an answer."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kiln.client import AsyncClient, Client, UnavailableError
from kiln.client.channel import ChannelSecurity
from kiln.errors import InvalidArgumentError
from kiln.server.app import ServeOptions, api_keys_for, http_url, try_it
from kiln.server.tls import TlsSettings
from tests.conftest import outcome_within
from tests.server.conftest import ServerHandle, start_server, tiny_model_dir
from tests.server.pki import Pki, write_pki

REFUSAL_BOUND_S = 30.0  # a refused call fails at the handshake; this only keeps a hang from hanging the run


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def _tls_server(servers_root: Path, pki: Pki, *extra: str) -> ServerHandle:
    flags = ("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), *extra)
    server = start_server(str(tiny_model_dir(servers_root)), servers_root / "cache", extra=flags)
    server.http_url = server.http_url.replace("http://", "https://")
    return server


@pytest.fixture(scope="module")
def tls_server(servers_root, pki) -> ServerHandle:
    server = _tls_server(servers_root, pki)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(servers_root, pki) -> ServerHandle:
    server = _tls_server(servers_root, pki, "--tls-client-ca", str(pki.client_ca))
    yield server
    server.stop()


def _turn(client: Client) -> list[int]:
    """A session and a short greedy generate on it: the tokens generated."""
    with client.create_session([5, 6, 7, 8]) as session:
        return list(session.generate(max_tokens=4, ignore_eos=True))


def _refused(call: object, what: str) -> BaseException:
    """The error `call` fails with (it must fail, within the bound)."""
    outcome = outcome_within(call, REFUSAL_BOUND_S, f"{what}: no answer nor refusal")
    assert isinstance(outcome, BaseException), f"{what} was answered: {outcome!r}"
    return outcome


def _completion(url: str, verify: ssl.SSLContext | bool = True) -> httpx.Response:
    with httpx.Client(timeout=REFUSAL_BOUND_S, verify=verify) as http:
        return http.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})


def _trusting(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context trusting `ca` (not the system's roots), presenting `cert` when given."""
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


# --- a server with a certificate ---------------------------------------------------------------------------

def test_the_ready_line_says_https(tls_server):
    ready = next(line for line in tls_server.log if line.startswith("kiln serve: ready"))
    assert f"http={tls_server.http_url} (no auth, TLS)" in ready


def test_sync_sdk_over_tls(tls_server, pki):
    with Client(tls_server.grpc_address, ca_file=str(pki.ca)) as client:
        assert client.health().status == "serving"
        assert len(_turn(client)) == 4


def test_asyncio_sdk_over_tls(tls_server, pki):
    async def flow() -> list[int]:
        async with AsyncClient(tls_server.grpc_address, ca_file=str(pki.ca)) as client:
            session = await client.create_session([5, 6, 7, 8])
            generation = await session.generate(max_tokens=4, ignore_eos=True)
            return [token async for token in generation]

    assert len(asyncio.run(flow())) == 4


def test_https_with_the_ca(tls_server, pki):
    reply = _completion(tls_server.http_url, _trusting(pki.ca))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_plaintext_clients_are_refused(tls_server):
    error = _refused(lambda: Client(tls_server.grpc_address).health(), "a plaintext gRPC call")
    assert isinstance(error, UnavailableError), repr(error)
    plain = tls_server.http_url.replace("https://", "http://")
    error = _refused(lambda: _completion(plain), "plaintext HTTP to the TLS port")
    assert isinstance(error, httpx.TransportError), repr(error)


@pytest.mark.parametrize("trust", ["other_ca", "system_roots"])
def test_a_client_trusting_another_ca_is_refused(tls_server, pki, trust):
    security = {"ca_file": str(pki.other_ca)} if trust == "other_ca" else {"tls": True}
    error = _refused(lambda: Client(tls_server.grpc_address, **security).health(), f"gRPC trusting {trust}")
    assert isinstance(error, UnavailableError), repr(error)
    verify = _trusting(pki.other_ca) if trust == "other_ca" else True
    error = _refused(lambda: _completion(tls_server.http_url, verify=verify), f"HTTPS trusting {trust}")
    assert isinstance(error, httpx.ConnectError) and "CERTIFICATE_VERIFY_FAILED" in str(error), repr(error)


def test_chat_over_tls(tls_server, pki):
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "chat", "--server", tls_server.grpc_address, "--tls-ca", str(pki.ca),
         "--max-tokens", "2"], input="hello\n", capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "generated 2" in run.stderr


# --- a server that requires client certificates ------------------------------------------------------------

def test_a_client_certificate_from_the_client_ca_is_served(mtls_server, pki):
    with Client(mtls_server.grpc_address, ca_file=str(pki.ca), cert_file=str(pki.client_cert),
                key_file=str(pki.client_key)) as client:
        assert len(_turn(client)) == 4
    reply = _completion(mtls_server.http_url, _trusting(pki.ca, pki.client_cert, pki.client_key))
    assert reply.status_code == 200, reply.text
    assert any("(no auth, TLS, client certificates required)" in line for line in mtls_server.log)


@pytest.mark.parametrize("holder", ["no_certificate", "another_ca"])
def test_a_client_without_a_certificate_from_the_client_ca_is_refused(mtls_server, pki, holder):
    pair = {} if holder == "no_certificate" else {"cert_file": str(pki.stranger_cert), "key_file": str(pki.stranger_key)}
    error = _refused(lambda: Client(mtls_server.grpc_address, ca_file=str(pki.ca), **pair).health(), f"gRPC, {holder}")
    assert isinstance(error, UnavailableError), repr(error)
    context = _trusting(pki.ca, *((pki.stranger_cert, pki.stranger_key) if pair else ()))
    error = _refused(lambda: _completion(mtls_server.http_url, context), f"HTTPS, {holder}")
    assert isinstance(error, httpx.TransportError), repr(error)


# --- bad settings: refused where they are given ------------------------------------------------------------

def test_bad_tls_flags_exit_2_before_loading_the_model(pki, tmp_path):
    """The model path does not exist: only TLS checked before the model loads gives this message."""
    run = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "serve", "--model", str(tmp_path / "no-model"), "--no-persist",
         "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 2, run.stderr
    assert f"--tls-key {pki.client_key} does not match the certificate in --tls-cert {pki.server_cert}" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(("flags", "message"), [
    ({"cert_file": "server_cert"}, "--tls-cert needs --tls-key"),
    ({"key_file": "server_key"}, "--tls-key needs --tls-cert"),
    ({"client_ca_file": "client_ca"}, "--tls-client-ca needs --tls-cert and --tls-key"),
    ({"cert_file": "missing", "key_file": "server_key"}, "cannot read --tls-cert {missing}: No such file or directory"),
    ({"cert_file": "junk", "key_file": "server_key"}, "--tls-cert {junk} holds no PEM certificate"),
    ({"cert_file": "server_cert", "key_file": "server_cert"}, "--tls-key {server_cert} holds no PEM private key"),
    ({"cert_file": "server_key", "key_file": "server_key"}, "--tls-cert {server_key} holds no PEM certificate"),
    ({"cert_file": "server_cert", "key_file": "encrypted_key"}, "--tls-key {encrypted_key} is encrypted"),
    ({"cert_file": "server_cert", "key_file": "client_key"},
     "--tls-key {client_key} does not match the certificate in --tls-cert {server_cert}"),
    ({"cert_file": "server_cert", "key_file": "server_key", "client_ca_file": "junk"},
     "--tls-client-ca {junk} holds no PEM certificate"),
    ({"cert_file": "server_cert", "key_file": "server_key", "client_ca_file": "pki"}, "cannot read --tls-client-ca {pki}"),
])
def test_bad_tls_settings_name_the_file_and_the_problem(pki, flags, message):
    files = _files(pki)
    args = {"cert_file": None, "key_file": None, "client_ca_file": None} | {k: files[v] for k, v in flags.items()}
    with pytest.raises(InvalidArgumentError) as refused:
        TlsSettings.from_flags(**args)
    assert message.format(**files) in str(refused.value)


def test_good_tls_settings_and_their_transport_arguments(pki):
    tls = TlsSettings.from_flags(str(pki.server_cert), str(pki.server_key), str(pki.client_ca))
    assert tls.client_auth and tls.private_key == pki.server_key.read_bytes()
    assert tls.uvicorn_kwargs()["ssl_ca_certs"] == str(pki.client_ca)
    assert TlsSettings.from_flags(None, None, None) is None
    options = ServeOptions(tls=tls)
    assert http_url(options).startswith("https://")
    assert 'cert_file="client.pem", key_file="client-key.pem"' in try_it(options, auth=False)


def test_tls_does_not_lift_the_rule_that_a_non_loopback_bind_needs_a_key(pki):
    tls = TlsSettings.from_flags(str(pki.server_cert), str(pki.server_key), str(pki.client_ca))
    with pytest.raises(InvalidArgumentError, match="refusing to serve on 0.0.0.0 without an API key"):
        api_keys_for(ServeOptions(host="0.0.0.0", env={}, tls=tls))


def test_the_banner_shows_the_tls_forms(pki):
    banner = try_it(ServeOptions(http_port=8443, tls=TlsSettings.from_flags(str(pki.server_cert), str(pki.server_key), None)),
                    auth=True)
    assert "curl -s --cacert ca.pem https://127.0.0.1:8443/v1/completions" in banner
    assert 'Client("127.0.0.1:50051", api_key=os.environ["KILN_API_KEY"], ca_file="ca.pem", tokenizer="server")' in banner
    assert 'base_url="https://127.0.0.1:8443/v1"' in banner and "DefaultHttpxClient(verify=context)" in banner
    assert "load_cert_chain" not in banner and "http://" not in banner


@pytest.mark.parametrize(("options", "message"), [
    ({"cert_file": "client_cert"}, "cert_file needs key_file"),
    ({"key_file": "client_key"}, "key_file needs cert_file"),
    ({"ca_file": "missing"}, "cannot read ca_file {missing}"),
    ({"ca_file": "junk"}, "ca_file {junk} holds no PEM certificate"),
    ({"cert_file": "client_cert", "key_file": "server_key"},
     "key_file {server_key} does not match the certificate in cert_file {client_cert}"),
])
def test_bad_sdk_tls_options_are_refused_when_the_client_is_made(pki, options, message):
    files = _files(pki)
    arguments = {k: files[v] for k, v in options.items()}
    for make in (lambda: Client("127.0.0.1:1", **arguments), lambda: ChannelSecurity.from_options(**arguments)):
        with pytest.raises(InvalidArgumentError) as refused:
            make()
        assert message.format(**files) in str(refused.value)


def test_sdk_files_imply_tls(pki):
    assert not ChannelSecurity.from_options().tls
    with pytest.raises(InvalidArgumentError, match="tls must be True or False"):
        Client("127.0.0.1:1", tls="yes")
    assert ChannelSecurity.from_options(tls=True).tls
    assert ChannelSecurity.from_options(ca_file=str(pki.ca)).root_certificates == pki.ca.read_bytes()
    assert ChannelSecurity.from_options(cert_file=str(pki.client_cert), key_file=str(pki.client_key)).tls


def _files(pki: Pki) -> dict[str, str]:
    """The PKI's paths by name, with a missing file and a directory."""
    return pki.paths() | {"missing": str(pki.ca.parent / "missing.pem"), "pki": str(pki.ca.parent)}
