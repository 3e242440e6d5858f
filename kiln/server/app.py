"""`kiln serve`: one process, one engine, gRPC and HTTP on one asyncio loop.

Shutdown on SIGINT/SIGTERM is graceful: stop admitting (new calls get UNAVAILABLE), let in-flight
generations finish for a grace period, cancel what is left, stop both servers, release every session.

Should the engine's loop die (kiln/engine/engine.py: its open requests have then ended UNAVAILABLE),
the server shuts down the same way and `serve` raises EngineFailedError, on which `kiln serve` exits
non-zero: a supervisor restarts it, and sessions come back from their snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import math
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import uvicorn

from kiln import startup
from kiln.engine.constraints import ConstraintCompiler, compiler_for
from kiln.engine.engine import Engine
from kiln.engine.stream import DEFAULT_STALL_TIMEOUT_S
from kiln.errors import InvalidArgumentError, UnavailableError
from kiln.heap import release_free_memory
from kiln.llm import LLM
from kiln.server.access_log import AccessLog
from kiln.server.auth import ApiKeys
from kiln.server.auth_failures import AuthFailures, ThrottleRule
from kiln.server.grpc import build_grpc_server
from kiln.server.grpc_limits import DEFAULT_GRPC_LIMITS, GrpcLimits
from kiln.server.http import build_http_app
from kiln.server.http_connections import HttpLimits, ensure_fd_limit
from kiln.server.http_guard import HttpGuard
from kiln.server.metrics import Metrics
from kiln.server.quotas import Quotas
from kiln.server.service import MAX_REQUEST_BYTES, RuntimeService, served_name
from kiln.server.tls import TlsSettings

INSTRUCT_MODEL = "smollm2-135m-instruct"  # the embedded instruct model the banner's chat examples use

EXIT_WAIT_S = 60.0  # after shutdown released every session: the most the process takes to end by itself
STRAGGLER_WAIT_S = 2.0  # once the main thread is done: how long other threads still get


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: int = 8000
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    insecure_no_auth: bool = False  # allow a non-loopback bind without API keys
    shutdown_grace_s: float = 3.0
    max_request_bytes: int = MAX_REQUEST_BYTES
    served_model_names: tuple[str, ...] = ()  # aliases of the model's id in the OpenAI API
    auth_failure_threshold: int = ThrottleRule.threshold  # failed authentications before an address waits; 0: never
    env: dict[str, str] | None = field(default=None, compare=False)
    tls: TlsSettings | None = None  # TLS on both ports (kiln/server/tls.py); None: plaintext
    allowed_hosts: tuple[str, ...] = ()  # more Host names the HTTP API answers (kiln/server/http_guard.py)
    cors_origins: tuple[str, ...] = ()  # web pages that may call the HTTP API
    http_limits: HttpLimits = HttpLimits()  # HTTP connection cap and timeouts (kiln/server/http_connections.py)
    access_log: AccessLog = AccessLog()  # format and content of the request log (kiln/server/access_log.py)
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S  # a generation paused by a client that stopped reading: cancelled after
    grpc_limits: GrpcLimits = DEFAULT_GRPC_LIMITS  # calls, streams, keepalive, connection idle/age (kiln/server/grpc_limits.py)
    chat_format: str = "auto"  # how /v1/chat/completions writes a conversation (kiln/chat.py)

    def __post_init__(self) -> None:
        self.http_guard()  # a bad --allowed-host or --cors-origin fails at start-up
        if self.max_request_bytes <= 0:
            raise InvalidArgumentError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        if self.auth_failure_threshold < 0:
            raise InvalidArgumentError(f"auth_failure_threshold must be 0 (off) or more, got {self.auth_failure_threshold}")
        if not 0 < self.stall_timeout_s < math.inf:
            raise InvalidArgumentError(f"stall_timeout_s must be a positive number of seconds, got {self.stall_timeout_s}")

    def http_guard(self) -> HttpGuard:
        return HttpGuard.for_bind(self.host, self.allowed_hosts, self.cors_origins)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_keys_for(options: ServeOptions) -> ApiKeys:
    """The configured keys; refuses to expose an unauthenticated server beyond this machine."""
    keys = ApiKeys.from_sources(options.api_keys, options.api_keys_file, options.env,
                                AuthFailures(ThrottleRule(threshold=options.auth_failure_threshold)))
    if not keys.enabled and not is_loopback(options.host) and not options.insecure_no_auth:
        raise InvalidArgumentError(
            f"refusing to serve on {options.host} without an API key: pass --api-key, --api-keys-file or "
            "KILN_API_KEY, or --insecure-no-auth if the network is trusted"
        )
    return keys


class EngineFailedError(UnavailableError):
    """The engine's loop died while serving; the server shut down. Not retryable in this process."""


def stop_on_engine_failure(engine: Engine, stop: asyncio.Event) -> None:
    """Sets `stop` when the engine's loop dies (at once if it already has). Call it on the loop that
    awaits `stop`: the dying engine thread hands the signal over to it."""
    loop = asyncio.get_running_loop()

    def on_failure(error: BaseException) -> None:  # the engine thread
        with contextlib.suppress(RuntimeError):  # the loop already closed: serve has ended anyway
            loop.call_soon_threadsafe(stop.set)

    engine.add_failure_observer(on_failure)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the serve loop owns SIGINT/SIGTERM for both servers."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201 - overrides uvicorn's context manager
        yield


@dataclass(frozen=True)
class ServingStack:
    """What both transports serve for one engine: keys, metrics, the service and the HTTP app. `kiln serve`
    adds the gRPC server and uvicorn; a fleet replica (kiln/fleet/replica.py) calls the HTTP app in process."""

    keys: ApiKeys
    metrics: Metrics
    service: RuntimeService
    model_name: str
    http_app: Callable

    @classmethod
    def build(cls, llm: LLM, options: ServeOptions) -> ServingStack:
        keys = api_keys_for(options)
        metrics = Metrics(llm)
        metrics.watch_auth(keys.failures)
        model_name = served_name(llm.loaded.display_name)
        service = RuntimeService(llm, model_name, options.served_model_names,
                                 Quotas(keys.limits, llm.sessions.owner_usage), stall_timeout_s=options.stall_timeout_s)
        # the constraint compiler's tokenizer index takes seconds on a large vocabulary: build it now, beside
        # startup, rather than in the first structured-output request
        loaded = llm.loaded
        threading.Thread(target=_warm, args=(compiler_for(loaded.fingerprint, loaded.tokenizer, loaded.config.vocab_size),),
                         name="kiln-grammar-warmup", daemon=True).start()
        http_app = build_http_app(service, keys, metrics, options.max_request_bytes, options.http_guard(),
                                  options.access_log, options.chat_format)
        return cls(keys, metrics, service, model_name, http_app)


async def serve_async(llm: LLM, options: ServeOptions, on_shut_down: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or the engine dies), then shut down; `on_shut_down` is called once
    every session is released (`serve` passes `exit_despite_stragglers`)."""
    stack = ServingStack.build(llm, options)
    keys, metrics, service, model_name, http_app = (stack.keys, stack.metrics, stack.service, stack.model_name,
                                                    stack.http_app)
    grpc_address = f"{options.host}:{options.grpc_port}"
    grpc_server = build_grpc_server(service, keys, metrics, grpc_address, options.max_request_bytes,
                                    tls=options.tls, access=options.access_log, limits=options.grpc_limits)
    http = _Uvicorn(uvicorn.Config(http_app, host=options.host, port=options.http_port,
                                   log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                   **options.http_limits.uvicorn_kwargs(),
                                   **(options.tls.uvicorn_kwargs() if options.tls else {})))
    startup.phase(f"listening on grpc={grpc_address} http={http_url(options)}")
    await grpc_server.start()
    http_task = asyncio.create_task(http.serve())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.02)
    if http_task.done():
        await grpc_server.stop(None)
        raise OSError(f"HTTP server could not start on {options.host}:{options.http_port}")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if options.api_keys_file:  # only then: SIGHUP otherwise keeps its default (a closed terminal ends the server)
        loop.add_signal_handler(signal.SIGHUP, reload_keys_soon, keys, options.api_keys_file)
    stop_on_engine_failure(llm.engine, stop)
    auth = "API keys required" if keys.enabled else "no auth"
    if options.tls:
        auth += f", {options.tls.describe()}"
    print(f"kiln serve: ready model={model_name} grpc={grpc_address} http={http_url(options)} ({auth})",
          file=sys.stderr, flush=True)
    print(try_it(options, keys.enabled), file=sys.stderr, flush=True)
    await stop.wait()
    try:
        await _shutdown(llm, service, grpc_server, http, http_task, options.shutdown_grace_s)
        if on_shut_down is not None:
            on_shut_down()
    finally:  # a dead engine is what the exit reports, even should the shutdown fail after it
        if (failure := llm.engine.failure) is not None:
            raise EngineFailedError(f"the engine failed while serving ({type(failure).__name__}: {failure})") from failure


def http_url(options: ServeOptions) -> str:
    scheme = "https" if options.tls else "http"
    return f"{scheme}://{options.host}:{options.http_port}"


_reloads: set[asyncio.Task] = set()


def reload_keys_soon(keys: ApiKeys, path: str) -> None:
    """SIGHUP: re-read the API keys file on a worker thread; a bad file is reported and the old keys stay."""

    async def reload() -> None:
        try:
            count = await asyncio.to_thread(keys.reload)
        except InvalidArgumentError as error:
            print(f"kiln serve: API keys not reloaded, the previous keys stay: {error}", file=sys.stderr, flush=True)
        else:
            print(f"kiln serve: API keys reloaded from {path} ({count} keys)", file=sys.stderr, flush=True)

    task = asyncio.get_running_loop().create_task(reload())
    _reloads.add(task)
    task.add_done_callback(_reloads.discard)


def try_it(options: ServeOptions, auth: bool, instruct_ports: tuple[int, int] | None = None) -> str:
    """The dashboard's address, then three ways to talk to the server, printed once it is ready, each one the embedded base model does
    well: a completion (curl), a session whose turns reuse its cache and that closes at the end, leaving
    nothing saved (the Python SDK), chat and JSON of a
    bounded schema (the `openai` package). Then chat and a tool call on the embedded instruct model, which
    needs a server of its own (one server serves one model): the command that starts it on
    `instruct_ports` (gRPC, HTTP; default: the next ports up) with this server's keys and TLS, and an
    `openai` script for it. The scripts run as printed from the repository. With TLS,
    ca.pem stands for the CA that signed --tls-cert (and client.pem / client-key.pem for a client
    certificate, with --tls-client-ca)."""
    http = http_url(options)
    instruct_grpc, instruct_http = instruct_ports or (options.grpc_port + 1, options.http_port + 1)
    instruct_url = http_url(replace(options, http_port=instruct_http))
    key = 'os.environ["KILN_API_KEY"]' if auth else '"none"'
    imports = "import os\n" if auth else ""
    header = ' -H "Authorization: Bearer $KILN_API_KEY"' if auth else ""
    sdk_key = ', api_key=os.environ["KILN_API_KEY"]' if auth else ""
    curl_tls, sdk_tls, openai_setup, openai_tls = _try_it_tls(options.tls)
    dashboard = f"{http}/dashboard" + (" (it asks for an API key)" if auth else "")
    return f"""
Dashboard (sessions, KV pages, prefix reuse, latency, snapshots; live): {dashboard}

Try it (from the repository; a base model such as the embedded one continues text, and chat reaches it as a
Q&A transcript, see --chat-format):
  curl -s{curl_tls} {http}/v1/completions -H 'Content-Type: application/json'{header} \\
       -d '{{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}}'

  .venv/bin/python - <<'PY'
{imports}from kiln.client import Client
with Client("{options.host}:{options.grpc_port}"{sdk_key}{sdk_tls}, tokenizer="server") as client, \\
        client.create_session() as session:  # closed at the end: nothing left saved on the server
    session.append_text("Questions and short answers.\\n")
    for question in ["What is the capital of France?", "And the capital of Italy?"]:
        session.append_text(f"Q: {{question}}\\nA:")  # each turn prefills only its new tokens
        answer = "".join(session.generate_text(max_tokens=16, stop=["\\n"]))
        info = session.info()
        print(f"{{question}}{{answer}}  [prefilled {{info.last_prefill_tokens}}, reused {{info.reused_tokens}}]")
PY

  .venv/bin/python - <<'PY'
{imports}import openai
{openai_setup}client = openai.OpenAI(base_url="{http}/v1", api_key={key}{openai_tls})
ask = [{{"role": "user", "content": "What is the capital of France?"}}]
print(client.chat.completions.create(model="kiln", messages=ask, temperature=0).choices[0].message.content)
city = {{"type": "object", "required": ["city", "country"], "properties": {{
    "city": {{"type": "string", "maxLength": 20}}, "country": {{"type": "string", "maxLength": 20}}}}}}
reply = client.chat.completions.create(model="kiln", messages=ask, temperature=0, response_format={{
    "type": "json_schema", "json_schema": {{"name": "city", "schema": city}}}})
print(reply.choices[0].message.content)
PY

Chat and tool calls: the embedded instruct model, SmolLM2-135M-Instruct, chats in its own template and calls
tools in its own format. One server serves one model: start a second one for it (another shell), then ask it:
  .venv/bin/kiln serve --model {INSTRUCT_MODEL} --grpc-port {instruct_grpc} --http-port {instruct_http}{_same_access(options, auth)}

  .venv/bin/python - <<'PY'
{imports}import openai
{openai_setup}client = openai.OpenAI(base_url="{instruct_url}/v1", api_key={key}{openai_tls})
ask = [{{"role": "system", "content": "You are a helpful assistant. Answer in one short sentence."}},
       {{"role": "user", "content": "What is the capital of France?"}}]
print(client.chat.completions.create(model="{INSTRUCT_MODEL}", messages=ask, temperature=0).choices[0].message.content)
weather = {{"type": "function", "function": {{"name": "get_weather", "parameters": {{
    "type": "object", "required": ["city"], "properties": {{"city": {{"type": "string"}}}}}}}}}}
ask = [{{"role": "user", "content": "What is the weather in Paris?"}}]
call = client.chat.completions.create(model="{INSTRUCT_MODEL}", messages=ask, tools=[weather], temperature=0,
                                      tool_choice="required").choices[0].message.tool_calls[0]
print(call.function.name, call.function.arguments)
ask += [{{"role": "assistant", "tool_calls": [call.model_dump()]}},
        {{"role": "tool", "tool_call_id": call.id, "content": '{{"temperature_c": 18, "sky": "sunny"}}'}}]
print(client.chat.completions.create(model="{INSTRUCT_MODEL}", messages=ask, tools=[weather],
                                     temperature=0).choices[0].message.content)
PY
"""


def _same_access(options: ServeOptions, auth: bool) -> str:
    """The flags that give a second server this one's address, key (the examples' $KILN_API_KEY) and TLS."""
    flags = "" if options.host == ServeOptions.host else f" --host {options.host}"
    flags += ' --api-key "$KILN_API_KEY"' if auth else ""
    if options.tls:
        flags += f" --tls-cert {options.tls.cert_file} --tls-key {options.tls.key_file}"
        flags += f" --tls-client-ca {options.tls.client_ca_file}" if options.tls.client_ca_file else ""
    return flags


def _try_it_tls(tls: TlsSettings | None) -> tuple[str, str, str, str]:
    """The banner's TLS form: curl's options, the SDK's arguments, the openai script's setup lines and its
    arguments ("" each without TLS)."""
    if tls is None:
        return "", "", "", ""
    curl, sdk = " --cacert ca.pem", ', ca_file="ca.pem"'
    setup = 'import ssl\ncontext = ssl.create_default_context(cafile="ca.pem")\n'
    if tls.client_auth:
        curl += " --cert client.pem --key client-key.pem"
        sdk += ', cert_file="client.pem", key_file="client-key.pem"'
        setup += 'context.load_cert_chain("client.pem", "client-key.pem")\n'
    return curl, sdk, setup, ", http_client=openai.DefaultHttpxClient(verify=context)"


async def _shutdown(llm: LLM, service: RuntimeService, grpc_server, http: uvicorn.Server, http_task: asyncio.Task,  # noqa: ANN001
                    grace_s: float) -> None:
    started = time.monotonic()
    if llm.engine.failure is not None:
        print("kiln serve: the engine failed (see the log above); shutting down", file=sys.stderr, flush=True)
    service.stop_admitting()
    deadline = started + grace_s
    while llm.engine.pending() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    cancelled = llm.engine.pending()
    llm.engine.shutdown()  # cancels whatever is still in flight
    await grpc_server.stop(grace=1.0)
    http.should_exit = True
    await http_task
    sessions = len(llm.sessions)
    llm.sessions.close_all()
    print(f"kiln serve: shut down in {time.monotonic() - started:.1f} s "
          f"({cancelled} generations cancelled, {sessions} sessions released)", file=sys.stderr, flush=True)


def serve(llm: LLM, options: ServeOptions) -> None:
    check_ports(options)
    for note in (ensure_fd_limit(options.http_limits), _wildcard_note(options)):
        if note:
            print(note, file=sys.stderr, flush=True)
    with options.access_log.writing():
        asyncio.run(serve_async(llm, options, exit_despite_stragglers))


def exit_despite_stragglers() -> None:
    """Called once shutdown released every session: a daemon thread ends the process if it does not end by
    itself, because a thread is stuck in a call (a worker of the HTTP or gRPC thread pools, which the
    interpreter and asyncio.run wait for forever). The process gets EXIT_WAIT_S to finish closing (the
    snapshot store included), then other threads get STRAGGLER_WAIT_S after the main thread is done; what
    is still running then is named, and the process exits with status 1 without it."""
    threading.Thread(target=_end_stragglers, name="kiln-exit-watch", daemon=True).start()


def _end_stragglers() -> None:
    main, me = threading.main_thread(), threading.current_thread()
    main.join(EXIT_WAIT_S)
    deadline = time.monotonic() + STRAGGLER_WAIT_S
    for thread in threading.enumerate():
        if thread not in (main, me) and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [thread.name for thread in threading.enumerate() if thread is not me and not thread.daemon and thread.is_alive()]
    if stuck:
        print(f"kiln serve: exiting although {len(stuck)} thread(s) did not end: {', '.join(stuck[:8])}",
              file=sys.stderr, flush=True)
        os._exit(1)


def _warm(compiler: ConstraintCompiler) -> None:
    """Build the grammar compiler's tokenizer index, then return to the OS what building it freed (a
    hundred megabytes on a 262k vocabulary: kiln/heap.py says why)."""
    compiler.warm()
    release_free_memory()


def _wildcard_note(options: ServeOptions) -> str | None:
    if not HttpGuard.wildcard(options.host) or options.allowed_hosts:
        return None
    return ("kiln serve: HTTP answers only requests for localhost, 127.0.0.1 or [::1] (Host), not for this "
            "machine's other names or addresses: list them with --allowed-host")


def check_ports(options: ServeOptions) -> None:
    """Refuse, naming each flag to change, ports this server cannot listen on (in use, or not allowed):
    `kiln serve` asks before it loads the model, so a busy port costs no load."""
    problems = []
    for flag, port in (("--grpc-port", options.grpc_port), ("--http-port", options.http_port)):
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((options.host, port))
            except OSError as error:
                why = "is in use" if error.errno == errno.EADDRINUSE else f"cannot be listened on ({error.strerror})"
                problems.append(f"{flag} {port} {why}")
    if problems:
        raise InvalidArgumentError(f"cannot serve on {options.host}: {' and '.join(problems)}; pick another with "
                                   f"{' / '.join(problem.split()[0] for problem in problems)}")
