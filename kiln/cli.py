"""`kiln` command line: generate and chat on the embedded model (or --model), serve it, manage snapshots."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
from dataclasses import dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kiln import startup  # first: Ctrl-C during the imports below (torch: seconds) exits quietly
from kiln.chat import CHAT_FORMATS, TRANSCRIPT_MAX_TOKENS, ChatFormat, chat_format, tokens_for_chat
from kiln.chat_tools import ChatTools, waiting_calls
from kiln.config import QUANTIZATIONS, SPECULATIVE_METHODS, EngineConfig
from kiln.engine.sampler import SamplingParams
from kiln.engine.stream import DEFAULT_STALL_TIMEOUT_S
from kiln.errors import InvalidArgumentError, KilnError
from kiln.kv.codec import CODECS
from kiln.kv.policy import POLICIES
from kiln.llm import LLM
from kiln.models.catalog import MODELS_DIR_ENV, available_models, models_directory, resolve
from kiln.models.facts import model_facts
from kiln.server.access_log import FORMATS
from kiln.server.grpc_limits import GrpcLimits
from kiln.server.http_connections import HttpLimits
from kiln.server.service import MAX_REQUEST_BYTES
from kiln.snapshots.commands import add_parser as add_snapshot_parser
from kiln.snapshots.instance import default_directory, instance_for_model, instance_lock
from kiln.text import TextDeltas

if TYPE_CHECKING:
    from kiln.server.app import ServeOptions

# Engine flags default to None (an unset flag keeps EngineConfig's value); their help shows these.
_ENGINE_DEFAULTS = {field.name: field.default for field in fields(EngineConfig)}
DEFAULT_CHAT_MAX_TOKENS = 256  # a chat reply's limit in a model's own template (its turns end by themselves)
# the sampling flags (_sampling_args) but --max-tokens, named as SamplingParams' fields
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")
EXIT_ENGINE_FAILED = 70  # sysexits' EX_SOFTWARE: an internal error; a supervisor restarts the server


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help where it has a default worth showing and its help does not
    already name it (engine flags name EngineConfig's, see _ENGINE_DEFAULTS)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == [] or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def _engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags mirroring EngineConfig (unset flags keep its defaults)."""
    parser.add_argument("--model", default=None,
                        help="a model's name, as `kiln models` lists them (the embedded gemma3-270m and "
                        "smollm2-135m-instruct, then the models directory's, $KILN_MODELS_DIR), or the path of an HF "
                        "model directory or .gguf file (default: gemma3-270m)")
    parser.add_argument("--kv-budget-mb", type=int, default=None, help=f"memory for KV pages, MiB: the pool is reserved at this size and committed as pages are first used (default {_ENGINE_DEFAULTS['kv_budget_bytes'] // 2**20})")
    parser.add_argument("--page-size", type=int, default=None, help=f"tokens per KV page (default {_ENGINE_DEFAULTS['page_size']})")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=None,
                        help="weights and activations (default auto: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="KV pages' dtype (default auto: float16 with quantised weights on the CPU, else --dtype)")
    parser.add_argument("--quantization", choices=[*QUANTIZATIONS, "none"], default=None,
                        help="int8 projections and LM head (default auto: int8 on AVX2 CPUs with a C++ compiler); "
                        "none = exact weights in --dtype")
    parser.add_argument("--deterministic", action="store_true", default=None,
                        help="bit-identical logits whatever the batch and prefill chunking (slower prefill; default off)")
    parser.add_argument("--decode-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="decode steps as CUDA graphs, one per batch-size bucket (default: on a GPU)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="launch the next greedy decode step before this one's tokens reach the host "
                        "(needs decode graphs; default: on where they are captured)")
    parser.add_argument("--speculative", choices=[*SPECULATIVE_METHODS, "none"], default=None,
                        help="speculative decoding from the session's history (default: ngram on the CPU, none on a GPU)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help=f"most draft tokens verified per step (default {_ENGINE_DEFAULTS['num_speculative_tokens']})")
    parser.add_argument("--max-num-seqs", type=int, default=None, help=f"requests batched in one step (default {_ENGINE_DEFAULTS['max_num_seqs']})")
    parser.add_argument("--max-seqs-per-caller", type=int, default=None,
                        help="most of those one caller (an API key; without keys, a connection) holds at once "
                        "(default: all while no other caller waits, a fair share when one does)")
    parser.add_argument("--max-batched-tokens", type=int, default=None, help="tokens in one step (default 1024 on the CPU, 8192 on a GPU)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None, help="most tokens of one prompt per step (default 256 on the CPU, 2048 on a GPU)")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest history, tokens (default: the model's context length)")
    parser.add_argument("--max-sessions", type=int, default=None, help=f"live sessions before LRU eviction (default {_ENGINE_DEFAULTS['max_sessions']})")
    parser.add_argument("--session-ttl-s", type=float, default=None, help=f"idle seconds before a session is evicted (default {_ENGINE_DEFAULTS['session_ttl_s']:g})")
    parser.add_argument("--generate-wait-s", type=float, default=None,
                        help="most seconds a generate waits for the earlier ones on its session, when its caller's deadline "
                        f"is not sooner (default {_ENGINE_DEFAULTS['generate_wait_s']:g})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, one per core)")
    parser.add_argument("--kv-policy", choices=POLICIES, default=None,
                        help="global layers' resident K/V: full (exact, grows), sink_window (bounded, forgets), "
                        f"restore (bounded, exact: evicted pages in tiers, streamed back); default {_ENGINE_DEFAULTS['kv_policy']}")
    parser.add_argument("--kv-sink-tokens", type=int, default=None, help=f"first tokens kept resident (sink_window, restore; default {_ENGINE_DEFAULTS['kv_sink_tokens']})")
    parser.add_argument("--kv-window-tokens", type=int, default=None, help=f"recent tokens kept resident (sink_window, restore; default {_ENGINE_DEFAULTS['kv_window_tokens']})")
    parser.add_argument("--kv-codec", choices=CODECS, default=None, help=f"how KV pages are stored, in the pool and the tiers (default {_ENGINE_DEFAULTS['kv_codec']})")
    parser.add_argument("--kv-host-budget-mb", type=int, default=None, help=f"host-memory tier budget, MiB, used as pages are evicted to it (default {_ENGINE_DEFAULTS['kv_host_budget_mb']})")
    parser.add_argument("--kv-disk-dir", default=None, help="directory of the disk tier (default: no disk tier)")
    parser.add_argument("--kv-disk-budget-mb", type=int, default=None, help=f"disk tier budget, MiB (default {_ENGINE_DEFAULTS['kv_disk_budget_mb']})")
    parser.add_argument("--kv-stream-chunk-tokens", type=int, default=None, help=f"keys per chunk of streamed attention (default {_ENGINE_DEFAULTS['kv_stream_chunk_tokens']})")
    parser.add_argument("--snapshot-dir", default=None, help="persist sessions and snapshots in this directory (default: none; kiln serve: see --no-persist)")
    parser.add_argument("--snapshot-store", default=None,
                        help="persist them in this store instead: redis://host:port/db (shared by several servers)")
    parser.add_argument("--prefix-store-mb", type=int, default=None,
                        help="with persistence, full KV pages are also written behind to the snapshot store as a prefix "
                        "cache that survives restarts: a prompt whose prefix the pool lacks fetches them (verified) "
                        "instead of recomputing; at most this many MiB, least recently used dropped first; 0 turns it "
                        f"off, as --no-persist does (default {_ENGINE_DEFAULTS['prefix_store_mb']})")
    parser.add_argument("--durable-turns", action="store_true", default=None,
                        help="send a turn's finish only once the turn is saved (no acknowledged turn lost to a crash; default off)")


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int | None, temperature: float) -> None:
    limit = "" if max_tokens else (f" (default: {TRANSCRIPT_MAX_TOKENS} in a transcript, {DEFAULT_CHAT_MAX_TOKENS} "
                                   "with a template)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens generated per turn{limit}")
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="keep only tokens at least this fraction as likely as the likeliest, in [0, 1] (0 = no cut)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="HF/vLLM's, in (0, 100]: tokens already in the history or the reply have their logit divided "
                        "by it when positive, multiplied otherwise (1 = off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: subtracted from the logit of every token the reply already holds")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: subtracted from a token's logit per time the reply already holds it")


def _chat_format_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-format", choices=CHAT_FORMATS, default="auto",
                        help="how chat turns are written: the model's chat template, or a User:/Assistant: transcript "
                        "that a base model continues and that stops at the next User: turn; auto = template when the "
                        "model has one (an instruct model), else transcript")


def _llm(args: argparse.Namespace) -> LLM:
    startup.phase(f"loading {args.model or 'the embedded Gemma 3 270M'}")
    llm = LLM(args.model, **engine_options(args))
    engine = llm.engine
    startup.phase(f"model ready: {engine.kv_pages} KV pages of {engine.kv_page_bytes // 1024} KiB, "
                  f"weights {engine.kv_format.weights}")
    return llm


def engine_options(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig's keywords from the engine flags (_engine_args) that were set."""
    options: dict[str, object] = {
        "page_size": args.page_size,
        "dtype": args.dtype,
        "kv_dtype": args.kv_dtype,
        "deterministic": args.deterministic,
        "decode_graphs": args.decode_graphs,
        "async_scheduling": args.async_scheduling,
        "num_speculative_tokens": args.num_speculative_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_seqs_per_caller": args.max_seqs_per_caller,
        "max_batched_tokens": args.max_batched_tokens,
        "prefill_chunk_tokens": args.prefill_chunk_tokens,
        "max_model_len": args.max_model_len,
        "max_sessions": args.max_sessions,
        "session_ttl_s": args.session_ttl_s,
        "generate_wait_s": args.generate_wait_s,
        "num_threads": args.threads,
        **{name: getattr(args, name) for name in (
            "kv_policy", "kv_sink_tokens", "kv_window_tokens", "kv_codec", "kv_host_budget_mb", "kv_disk_dir",
            "kv_disk_budget_mb", "kv_stream_chunk_tokens")},
        "snapshot_dir": args.snapshot_dir,
        "snapshot_store": args.snapshot_store,
        "durable_turns": args.durable_turns,
        "prefix_store_mb": args.prefix_store_mb,
        "instance_id": getattr(args, "instance_id", None),
    }
    if args.kv_budget_mb:
        options["kv_budget_bytes"] = args.kv_budget_mb * 1024**2
    options = {k: v for k, v in options.items() if v is not None}
    for name in ("quantization", "speculative"):  # "none" turns it off: None, unlike an unset flag
        if (value := getattr(args, name)) is not None:
            options[name] = None if value == "none" else value
    return options


def _sampling_options(args: argparse.Namespace) -> dict[str, object]:
    """The sampling flags but --max-tokens (each command settles that its way) by SamplingParams' names,
    checked: an out-of-range value is refused naming its field, before any model loads."""
    options = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    SamplingParams(**options)
    return options


def cmd_generate(args: argparse.Namespace) -> None:
    params = SamplingParams(max_tokens=args.max_tokens, **_sampling_options(args))
    with _llm(args) as llm:
        session = llm.create_session(llm.tokenizer.encode(args.prompt))
        for piece in session.generate_text(params):
            print(piece, end="", flush=True)
        print()


def cmd_chat(args: argparse.Namespace) -> None:
    _sampling_options(args)  # an out-of-range flag is refused before a model loads or a server is called
    if args.server and args.tools:
        raise InvalidArgumentError("--tools chats in process: it needs the model's chat template (drop --server)")
    if args.server:
        from kiln.client import Client

        with Client(args.server, api_key=args.api_key, tokenizer="server", ca_file=args.tls_ca) as client:
            print(f"kiln chat: server {args.server}", file=sys.stderr)
            tokenizer = _RemoteTokenizer(client)
            _chat_loop(client, tokenizer, chat_format(tokenizer, args.chat_format), args)
        return
    with _llm(args) as llm:
        name = llm.loaded.display_name
        print(f"kiln chat: {name} (in process)", file=sys.stderr)
        form = chat_format(llm.tokenizer, args.chat_format)
        if form.transcript and not llm.tokenizer.chat_template:
            print(f"note: {name} is a base model (no chat template): it continues text, so each turn is a line of a "
                  "Q&A transcript; it answers short factual questions and completes text, but follows no long "
                  "instructions", file=sys.stderr)
        tools = ChatTools.from_file(args.tools, llm.tokenizer, args.tool_choice) if args.tools else None
        _chat_loop(llm, llm.tokenizer, form, args, tools)


class _RemoteTokenizer:
    """The slice of Tokenizer the chat formatting needs, answered by a server's Tokenize RPCs. The
    server's chat template is not visible from here: `--chat-format auto` chats in a transcript."""

    chat_template = None

    def __init__(self, client: object) -> None:
        self.client = client

    def token_to_id(self, token: str) -> int | None:
        ids = self.client.tokenize(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.client.tokenize(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.client.detokenize(ids, skip_special_tokens=True)


# What a chat line starting with "/" does instead of going to the model ("//" sends a line with one "/").
CHAT_COMMANDS = {
    "/help": "list these commands",
    "/reset": "start over: a new session, no turns (the system prompt stays)",
    "/system TEXT": "set the system prompt from the next turn on (no TEXT: remove it)",
    "/fork": "go on in a fork of this session; the session so far stays as it is (its id is printed)",
    "/save": "save the session as a snapshot and print its id (needs persistence: --snapshot-dir, or a "
             "server that persists)",
    "/quit": "end the chat (as does the end of input); the session is closed, snapshots stay",
}


@dataclass
class _Conversation:
    """One chat: the session its turns go to, the tokens that session holds, the turns so far and the
    system prompt."""

    session: Any  # kiln.llm.Session in process, kiln.client.Session remote
    history: list[int] = field(default_factory=list)
    turns: list[dict[str, str]] = field(default_factory=list)
    system: str | None = None

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns


def _chat_loop(host: Any, tokenizer: Any, form: ChatFormat, args: argparse.Namespace,
               tools: ChatTools | None = None) -> None:
    """Turns on one session, in process (`host` an LLM) or remote (a Client); lines starting with "/" are
    CHAT_COMMANDS. The session is closed when the chat ends (a /fork's earlier session and /save's
    snapshots stay)."""
    interactive = sys.stdin.isatty()
    default = form.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    options = {"max_tokens": default if args.max_tokens is None else args.max_tokens,
               **_sampling_options(args), "stop": form.stop}
    chat = _Conversation(host.create_session())
    try:
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                if not _chat_command(chat, host, line.strip()):
                    break
                continue
            _chat_turn(chat, line.removeprefix("/"), tokenizer, form, options, tools)
    finally:
        with contextlib.suppress(KilnError):  # a server gone meanwhile: its sessions went with it, or lapse
            chat.session.close()


def _chat_command(chat: _Conversation, host: Any, line: str) -> bool:
    """Run one of CHAT_COMMANDS; False when the chat ends."""
    name, _, text = line.partition(" ")
    if name == "/quit":
        return False
    if name == "/help":
        _say("\n".join(f"{command:<14} {what}" for command, what in CHAT_COMMANDS.items()))
    elif name == "/reset":
        chat.session.close()
        chat.session, chat.history, chat.turns = host.create_session(), [], []
        _say("a new conversation" + (" (the system prompt stays)" if chat.system else ""))
    elif name == "/system":
        chat.system = text.strip() or None
        _say(f"system prompt set: {chat.system}" if chat.system else "system prompt removed")
    elif name == "/fork":
        previous = chat.session
        chat.session = previous.fork()
        _say(f"forked: the conversation goes on in session {chat.session.id}; session {previous.id} stays as it was")
    elif name == "/save":
        try:
            snapshot_id = chat.session.snapshot()
        except KilnError as error:
            _say(f"not saved: {error}")
        else:
            _say(f"saved as snapshot {snapshot_id}")
    else:
        _say(f"unknown command {name}: /help lists them (start a line with // to send it with one /)")
    return True


def _chat_turn(chat: _Conversation, line: str, tokenizer: Any, form: ChatFormat, options: dict[str, Any],
               tools: ChatTools | None = None) -> None:
    """One turn. It renders the whole conversation as /v1/chat/completions does (kiln/chat.py) and appends
    only what the history lacks; where the rendering departs from the history (a reply the format writes
    otherwise than it was generated, a new system prompt), the session forks at the last token they
    share, so the cache still serves all before it. With tools, a line answers the oldest call still
    waiting for its result (kiln/chat_tools.py); the model replies once every call has one."""
    chat.turns.append(tools.message(line, chat.turns) if tools else {"role": "user", "content": line})
    if tools and (waiting := len(waiting_calls(chat.turns))):
        _say(f"{waiting} more call(s) wait for a result: type the next one")
        return
    prompt = tokens_for_chat(chat.messages(), tokenizer, tools.tools if tools else (), form=form)
    shared = _shared_prefix(chat.history, prompt)
    if shared < len(chat.history):
        forked = chat.session.fork(shared)
        chat.session.close()
        chat.session = forked
    chat.session.append(prompt[shared:])
    print("model> ", end="", flush=True)
    stream = chat.session.generate(**options, **({"grammar": tools.grammar(chat.turns[-1])} if tools else {}))
    deltas = TextDeltas(tools.decode if tools else tokenizer.decode, form.stop)
    calls = tools.reply() if tools else None
    reply = ""
    for token in stream:
        piece = deltas.push([token])
        print(calls.push(piece) if calls else _shown(reply, piece, form), end="", flush=True)
        reply += piece
    result = stream.result()
    rest = deltas.finish(result.stop_string)
    print(calls.push(rest) + calls.finish(result.finish_reason != "length") if calls else _shown(reply, rest, form),
          end="")
    reply += rest
    chat.history = prompt + list(result.token_ids)
    chat.turns.append(calls.message() if calls else
                      {"role": "assistant", "content": reply.removeprefix(" ") if form.transcript else reply})
    print("\n  " + _turn_stats(result, chat.session.info().history_tokens), file=sys.stderr)
    if tools and (waiting := len(waiting_calls(chat.turns))):
        _say(f"the model called {waiting} tool(s): type each call's result (text or JSON), one line each")


def _say(text: str) -> None:
    """A chat command's answer: on stderr, beside the turn statistics (stdout holds the conversation)."""
    print("  " + text.replace("\n", "\n  "), file=sys.stderr, flush=True)


def _shared_prefix(first: list[int], second: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b), min(len(first), len(second)))


def _shown(reply: str, piece: str, form: ChatFormat) -> str:
    """A piece of the reply as printed: a transcript's reply opens with the space after "Assistant:"."""
    return piece.removeprefix(" ") if form.transcript and not reply else piece


def _turn_stats(result: object, history: int) -> str:
    decode_s = result.total_s - (result.time_to_first_token_s or 0.0)
    generated = len(result.token_ids)
    rate = (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0
    return (f"[prefilled {result.usage.prefilled_tokens} · reused {result.usage.reused_tokens} from cache · "
            f"generated {generated} · TTFT {result.time_to_first_token_s or 0.0:.2f} s · {rate:.1f} tok/s · "
            f"history {history} tokens]")


def cmd_serve(args: argparse.Namespace) -> int:
    """0 after a graceful shutdown; EXIT_ENGINE_FAILED when the engine died, for a supervisor to
    restart the server (a refused configuration is a KilnError: 2, not worth restarting)."""
    from kiln.server.access_log import AccessLog
    from kiln.server.app import ServeOptions, api_keys_for, check_ports
    from kiln.server.tls import TlsSettings

    options = ServeOptions(
        host=args.host, grpc_port=args.grpc_port, http_port=args.http_port, api_keys=tuple(args.api_key),
        api_keys_file=args.api_keys_file, insecure_no_auth=args.insecure_no_auth, shutdown_grace_s=args.shutdown_grace_s,
        max_request_bytes=args.max_request_bytes, served_model_names=tuple(args.served_model_name),
        auth_failure_threshold=args.auth_failure_threshold,
        tls=TlsSettings.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca),  # checked before the model loads
        allowed_hosts=tuple(args.allowed_host), cors_origins=tuple(args.cors_origin),
        http_limits=HttpLimits(args.max_connections, args.http_idle_timeout_s, args.http_header_timeout_s,
                               args.http_body_timeout_s),
        access_log=AccessLog(args.log_format, args.log_content),
        stall_timeout_s=args.stall_timeout_s, grpc_limits=GrpcLimits(max_concurrent_rpcs=args.max_concurrent_rpcs),
        chat_format=args.chat_format,
    )
    if args.no_persist and (args.snapshot_dir or args.snapshot_store):
        raise InvalidArgumentError("--no-persist contradicts --snapshot-dir / --snapshot-store")
    api_keys_for(options)  # refuse an unsafe bind, or a port in use, before spending seconds on loading the model
    check_ports(options)
    if args.no_persist:
        return _serve(args, options)
    if args.snapshot_store or args.snapshot_dir:  # a store shared explicitly: its servers name their instances apart
        if args.instance_id is None:  # stable across restarts: a restarted server takes its sessions back at once
            args.instance_id = f"{socket.gethostname()}-{args.host}-{args.grpc_port}"
        return _serve(args, options)
    # a server persists sessions unless told not to, in its instance's own directory (kiln/snapshots/instance.py)
    args.instance_id = args.instance_id or instance_for_model(args.model)
    with instance_lock(args.instance_id) as directory:
        args.snapshot_dir = str(directory)
        return _serve(args, options)


def _serve(args: argparse.Namespace, options: ServeOptions) -> int:
    from kiln.server.app import EngineFailedError, serve

    with _llm(args) as llm:
        try:
            serve(llm, options)
        except EngineFailedError as error:
            print(f"kiln: {error.code}: {error}; exiting with status {EXIT_ENGINE_FAILED}", file=sys.stderr)
            return EXIT_ENGINE_FAILED
    return 0


def cmd_models(args: argparse.Namespace) -> None:
    """The embedded models, then the models directory's, each with its facts read from its files' headers
    (no weights loaded); a model whose files cannot be read is listed with the reason."""
    rows = []
    for entry in available_models():
        row: dict[str, Any] = {"name": entry.name, "origin": entry.origin}
        try:
            path = entry.path()
            row |= {**model_facts(path).to_json(), "path": str(path)}
        except KilnError as error:
            row["error"] = str(error)
        rows.append(row)
    if args.json:
        print("\n".join(json.dumps(row) for row in rows))
        return
    print(_models_table(rows))
    print(f"\nmodels directory: {models_directory()} (${MODELS_DIR_ENV}: *.gguf files and HF directories, "
          "named by file or folder name); any other path works as --model too", file=sys.stderr)


def _models_table(rows: list[dict[str, Any]]) -> str:
    header = ("NAME", "ARCHITECTURE", "PARAMETERS", "WEIGHTS", "CONTEXT", "CHAT TEMPLATE", "SIZE", "FROM")
    lines = [header]
    for row in rows:
        if "error" in row:
            lines.append((row["name"], f"unreadable: {row['error']}", "", "", "", "", "", row["origin"]))
            continue
        lines.append((row["name"], row["architecture"], _count(row["parameters"]), row["weight_type"],
                      str(row["context_length"] or "?"), "yes" if row["chat_template"] else "no",
                      f"{row['size_bytes'] / 2**20:.0f} MiB", row["origin"]))
    widths = [max(len(line[column]) for line in lines) for column in range(len(header) - 1)]
    return "\n".join("  ".join([*(cell.ljust(width) for cell, width in zip(line, widths, strict=False)), line[-1]])
                     for line in lines)


def _count(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


def cmd_fleet(args: argparse.Namespace) -> int:
    from kiln.fleet.command import run

    resolve(args.model)  # an unknown name is refused here, not in every replica Ray starts
    return run(args, engine_options(args))


def _version() -> str:
    try:
        return version("kiln")
    except PackageNotFoundError:  # a checkout run without installing it
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: a session-native LLM inference runtime")
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="print the continuation of a prompt", formatter_class=_DefaultsFormatter)
    generate.add_argument("--prompt", required=True)
    _engine_args(generate)
    _sampling_args(generate, max_tokens=64, temperature=0.0)
    generate.set_defaults(run=cmd_generate)
    chat = commands.add_parser("chat", help="interactive chat on one session, with per-turn cache statistics",
                               formatter_class=_DefaultsFormatter)
    _engine_args(chat)
    chat.add_argument("--server", default=None, help="talk to a running `kiln serve` (gRPC address) instead")
    chat.add_argument("--api-key", default=None, help="API key for --server")
    chat.add_argument("--tls-ca", default=None, help="PEM CA to trust: talk to --server over TLS")
    chat.add_argument("--tools", default=None, metavar="FILE.json",
                      help="functions the model may call, as OpenAI's `tools` list (in process): each call is shown, "
                      "and the lines you type next are the calls' results")
    chat.add_argument("--tool-choice", default="auto", metavar="auto|required|NAME",
                      help="with --tools: a reply to your line may call (auto), must call (required), or must call "
                      "that function; a reply to results may always answer in text")
    _chat_format_arg(chat)
    _sampling_args(chat, max_tokens=None, temperature=0.0)
    chat.set_defaults(run=cmd_chat)
    serve = commands.add_parser("serve", help="serve gRPC and the OpenAI-compatible HTTP API on one engine",
                                formatter_class=_DefaultsFormatter)
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address both ports bind")
    serve.add_argument("--grpc-port", type=int, default=50051, help="gRPC port")
    serve.add_argument("--http-port", type=int, default=8000, help="HTTP port (OpenAI API, REST, metrics)")
    _chat_format_arg(serve)
    serve.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    serve.add_argument("--api-keys-file", default=None, help="API keys: one per line, or TOML [keys.NAME] with key_sha256 and limits; SIGHUP re-reads it")
    serve.add_argument("--insecure-no-auth", action="store_true", help="allow a non-loopback bind without keys")
    serve.add_argument("--auth-failure-threshold", type=int, default=20,
                       help="failed authentications from one address within a minute before it must wait (0: off)")
    serve.add_argument("--shutdown-grace-s", type=float, default=3.0, help="time in-flight generations get on shutdown")
    serve.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                       help="largest request body (HTTP) or message (gRPC) accepted, bytes")
    serve.add_argument("--served-model-name", action="append", default=[],
                       help="another id the OpenAI API accepts and lists for the model (repeatable)")
    serve.add_argument("--instance-id", default=None,
                       help="this server's name: its own snapshot directory (DATA/kiln/instances/NAME/snapshots, one "
                       "live server each) and its name among servers sharing a store (default: the model's name; with "
                       "--snapshot-dir/--snapshot-store: host and gRPC address)")
    serve.add_argument("--tls-cert", default=None, help="PEM certificate (chain): serve TLS on both ports (needs --tls-key)")
    serve.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (unencrypted)")
    serve.add_argument("--tls-client-ca", default=None,
                       help="PEM CA: both ports require a client certificate signed by it (needs --tls-cert)")
    serve.add_argument("--allowed-host", action="append", default=[],
                       help="another Host name (or address) the HTTP API answers, any port (repeatable; always: localhost, "
                       "127.0.0.1, [::1] and --host unless 0.0.0.0/::). Other names get 421 (DNS rebinding). '*' turns "
                       "the check off: unsafe unless a proxy in front checks Host")
    serve.add_argument("--cors-origin", action="append", default=[],
                       help="a web page origin (scheme://host[:port]) that may call the HTTP API (repeatable; default: "
                       "none, and requests from other pages are refused)")
    serve.add_argument("--max-connections", type=int, default=HttpLimits.max_connections,
                       help="open HTTP connections; one more is answered 503 and closed")
    serve.add_argument("--http-idle-timeout-s", type=float, default=HttpLimits.idle_timeout_s,
                       help="an HTTP connection that starts no request for this long is closed")
    serve.add_argument("--http-header-timeout-s", type=float, default=HttpLimits.header_timeout_s,
                       help="a request's headers must be complete this long after its first byte, else the connection closes")
    serve.add_argument("--http-body-timeout-s", type=float, default=HttpLimits.body_timeout_s,
                       help="a request body that stalls this long between pieces is answered 408 and closed")
    serve.add_argument("--log-format", choices=FORMATS, default="text",
                       help="access log on stderr, one line per request: key=value text or one JSON object")
    serve.add_argument("--log-content", action="store_true",
                       help="access log lines carry request and response content (prompts, tokens); off by default")
    serve.add_argument("--stall-timeout-s", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                       help="a stream whose client stops reading is paused; still unread after this long, its generation is "
                       "cancelled (its tokens so far stay in the session) and the call ends")
    serve.add_argument("--max-concurrent-rpcs", type=int, default=GrpcLimits.max_concurrent_rpcs,
                       help="gRPC calls in flight (0: no limit); more get RESOURCE_EXHAUSTED. Also enforced: 256 streams "
                       "per connection, client pings at most every 10 s and only during calls, idle connections closed "
                       "after 5 min, connections asked to go away after 1 h (calls in flight get 24 h)")
    serve.add_argument("--no-persist", action="store_true",
                       help=f"keep sessions (and the prefix store) in memory only (default: persist them in "
                       f"{default_directory().parent.parent}/INSTANCE/snapshots, see --instance-id)")
    serve.set_defaults(run=cmd_serve)
    fleet = commands.add_parser("fleet", help="serve N replicas on Ray Serve, each session routed to the replica that "
                                "holds it (needs the fleet extra and a Redis snapshot store)",
                                formatter_class=_DefaultsFormatter)
    _engine_args(fleet)
    fleet.add_argument("--replicas", type=int, default=2, help="engines, one per Ray Serve replica")
    fleet.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    fleet.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (auto: the running local one; default: start one when none runs)")
    fleet.add_argument("--host", default="127.0.0.1", help="address of the fleet's HTTP port (Ray Serve's proxy)")
    fleet.add_argument("--http-port", type=int, default=8000, help="the fleet's HTTP port (OpenAI API, REST)")
    fleet.add_argument("--grpc-port", type=int, default=None,
                       help="the fleet's gRPC port (the SDKs' kiln.v1.Runtime; Ray Serve's gRPC proxy, which listens "
                       "on every interface, so it needs an API key or --insecure-no-auth); default: no gRPC")
    _chat_format_arg(fleet)
    fleet.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    fleet.add_argument("--api-keys-file", default=None, help="API keys file, as kiln serve's (read by every replica)")
    fleet.add_argument("--insecure-no-auth", action="store_true", help="allow a non-loopback bind without keys")
    fleet.add_argument("--served-model-name", action="append", default=[],
                       help="another id the OpenAI API accepts and lists for the model (repeatable)")
    fleet.add_argument("--allowed-host", action="append", default=[],
                       help="another Host name (or address) the HTTP API answers (repeatable), as kiln serve's")
    fleet.set_defaults(run=cmd_fleet)
    models = commands.add_parser("models", help="list the models --model can name, with what their files say")
    models.add_argument("--json", action="store_true", help="one JSON object per model instead of a table")
    models.set_defaults(run=cmd_models)
    add_snapshot_parser(commands)
    args = parser.parse_args(argv)
    try:
        with startup.enabled(f"kiln {args.command}"):
            status = args.run(args)
    except KilnError as error:
        print(f"kiln: {error.code}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
