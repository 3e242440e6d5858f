"""A tool-calling agent through the OpenAI API, killed with SIGKILL halfway: tokens prefilled and latency
per turn on each way an OpenAI client can reach a server, against llama.cpp's own server.

The agent (SmolLM2-135M-Instruct, greedy, `--max-tokens` per reply) holds one conversation of `--turns`
turns. Odd turns ask the weather in a city and name the one function, get_weather, in tool_choice, so every
path makes the same call; the bench answers each call with a result computed from its arguments, and the
model then answers under tool_choice "auto". Even turns ask about that city under "auto". The tools are
offered on every request: under "none" Kiln leaves them out of the rendered prompt, which would change the
conversation's opening and void every cache. A reply under "auto" that calls anyway gets its results too,
up to MAX_REQUESTS requests a turn (results still owed open the next turn).

Paths, each on a server of its own with a store of its own:
- responses: Kiln's POST /v1/responses; each request sends only the new items and previous_response_id;
- kiln-session: Kiln's /v1/chat/completions with `Kiln-Session: NAME`, the whole conversation re-sent;
- kiln-stateless: the same requests without the header (the status quo: the prefix cache, and with
  persistence the persistent prefix store);
- llamacpp-server: llama.cpp's C++ server (`--llama-server`) on the same GGUF file, one slot,
  /v1/chat/completions with `cache_prompt` (its default, sent explicitly), the whole conversation re-sent.
  SmolLM2's own template takes no tools, and under such a template this llama-server drops them, so it
  runs bench/data/smollm2_tools.jinja: that template with the tools and calls written as Kiln writes them
  (the same prompt, token for token). Its tool_choice "required" lets the model write text first (this one
  then never calls within the limit), so a forced request ends with the call's opening as an assistant
  message, which llama-server continues and parses as the call.

Prefilled tokens are what the server computed for a request's prompt: prompt_tokens - cached_tokens
(usage.prompt_tokens_details, or input_tokens_details on the Responses API) on Kiln, timings.prompt_n on
llama.cpp. A turn's latency is its requests' wall time at the client. After turn `--restart-after` the
server is killed with SIGKILL and started again with the same command (Kiln: the same --snapshot-dir;
llama.cpp: its slot and RAM prompt cache die with it); the restart's own seconds are recorded apart. A path
whose server or endpoint is missing is recorded as unavailable with the reason, never estimated.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import common
import openai
import servers

MODEL = "smollm2-135m-instruct"
MAX_REQUESTS = 3  # per turn: a forced call, its answer, and one more call the model may make under "auto"
REQUEST_TIMEOUT_S = 900.0
LLAMA_CTX = 8192  # SmolLM2's trained context, as Kiln serves it
# SmolLM2's template with tools written as Kiln writes them (llama-server drops tools under a template that takes none)
LLAMA_TEMPLATE = common.BENCH_DIR / "data" / "smollm2_tools.jinja"
# how a call begins in that syntax (Hermes): what Kiln's grammar makes a forced reply begin with
CALL_OPENING = "<tool_call>\n"
# the cmake options of a llama-server build that the results record (from the build tree's CMakeCache.txt)
BUILD_OPTIONS = ("CMAKE_BUILD_TYPE", "GGML_NATIVE", "GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_VBMI",
                 "GGML_AVX512_BF16", "GGML_AMX_INT8", "GGML_AMX_TILE", "LLAMA_CURL", "LLAMA_OPENSSL",
                 "BUILD_SHARED_LIBS", "CMAKE_CXX_COMPILER")
PATHS = ("responses", "kiln-session", "kiln-stateless", "llamacpp-server")
LABELS = {
    "responses": "Kiln, Responses API (previous_response_id)",
    "kiln-session": "Kiln, chat completions + Kiln-Session",
    "kiln-stateless": "Kiln, stateless chat completions",
    "llamacpp-server": "llama.cpp llama-server (cache_prompt)",
}
SESSION_NAME = "agents-api-bench"
SYSTEM = ("You are a travel assistant. Call get_weather when asked about the weather, then answer in one "
          "short sentence.")
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Oslo", "Dublin", "Athens",
          "Warsaw", "Budapest", "Stockholm", "Helsinki", "Amsterdam", "Brussels", "Copenhagen", "Zurich",
          "Edinburgh", "Krakow", "Seville", "Porto", "Naples", "Munich", "Lyon")
SKIES = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy")
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                      "required": ["city"], "additionalProperties": False}
WEATHER_DESCRIPTION = "The current weather in a city."
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "description": WEATHER_DESCRIPTION,
                                              "parameters": WEATHER_PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": WEATHER_DESCRIPTION,
                  "parameters": WEATHER_PARAMETERS, "strict": True}


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


@dataclass
class Reply:
    """One request: what the server computed for it, how long the client waited, what the model wrote."""
    prompt_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    seconds: float
    text: str
    calls: list[ToolCall]
    recomputed: str | None = None  # Kiln-Session-Recomputed: why a named session computed anything again


def user_message(turn: int) -> str:
    """Turn `turn` (1-based): odd turns ask the weather (a forced call), even ones follow up on that city."""
    city = CITIES[(turn - 1) // 2 % len(CITIES)]
    if turn % 2:
        return f"What is the weather in {city} right now?"
    return f"Suggest one thing to do in {city} in that weather, in one sentence."


def tool_result(call: ToolCall) -> str:
    """The weather the bench reports: a function of the call's arguments, so every path sees the same."""
    try:
        city = str(json.loads(call.arguments).get("city", ""))
    except (json.JSONDecodeError, AttributeError):
        city = ""
    digest = zlib.crc32(city.encode())
    return json.dumps({"city": city, "temperature_c": 5 + digest % 25, "sky": SKIES[digest % len(SKIES)]})


class ChatAgent:
    """The conversation re-sent whole on every request, as OpenAI chat clients do: Kiln with or without
    `Kiln-Session`."""

    def __init__(self, api_key: str, headers: dict[str, str], max_tokens: int) -> None:
        self.api_key, self.headers, self.max_tokens = api_key, headers, max_tokens
        self.messages: list[dict[str, Any]] = []
        self.client: openai.OpenAI | None = None

    def connect(self, base_url: str) -> None:
        """Point at a (re)started server; the conversation is the agent's and goes on."""
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=self.api_key, max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S, default_headers=self.headers)

    def request_messages(self, force_call: bool) -> list[dict[str, Any]]:
        return self.messages

    def tool_choice(self, force_call: bool) -> Any:
        return {"type": "function", "function": {"name": "get_weather"}} if force_call else "auto"

    def extra_body(self) -> dict[str, Any] | None:
        return None

    def prefilled(self, completion: Any) -> int:
        usage = completion.usage
        details = usage.prompt_tokens_details
        return usage.prompt_tokens - ((details.cached_tokens or 0) if details else 0)

    def send(self, items: list[dict[str, Any]], force_call: bool) -> Reply:
        self.messages += items
        start = time.perf_counter()
        raw = self.client.chat.completions.with_raw_response.create(
            model=MODEL, messages=self.request_messages(force_call), tools=[CHAT_TOOL],
            tool_choice=self.tool_choice(force_call), temperature=0, max_tokens=self.max_tokens,
            extra_body=self.extra_body())
        completion = raw.parse()
        seconds = time.perf_counter() - start
        message = completion.choices[0].message
        calls = [ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        echo: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            echo["tool_calls"] = [{"id": c.call_id, "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        self.messages.append(echo)
        return Reply(completion.usage.prompt_tokens, self.prefilled(completion), completion.usage.completion_tokens,
                     seconds, message.content or "", calls, raw.headers.get("Kiln-Session-Recomputed"))


class LlamaCppAgent(ChatAgent):
    """llama-server's chat completions. Its tool_choice is a string, and "required" lets the model write text
    before the call (this one then writes until max_tokens): a forced request ends with the start of the call
    as an assistant message, which llama-server continues (its prefill) and parses as the call. Prefilled is
    its timings.prompt_n."""

    def request_messages(self, force_call: bool) -> list[dict[str, Any]]:
        return [*self.messages, *([{"role": "assistant", "content": CALL_OPENING}] if force_call else [])]

    def tool_choice(self, force_call: bool) -> Any:
        return "required" if force_call else "auto"

    def extra_body(self) -> dict[str, Any] | None:
        return {"cache_prompt": True, "parallel_tool_calls": False}

    def prefilled(self, completion: Any) -> int:
        return int(completion.model_extra["timings"]["prompt_n"])


class ResponsesAgent:
    """The Responses API: only the new items each request, chained by previous_response_id."""

    def __init__(self, api_key: str, max_tokens: int) -> None:
        self.api_key, self.max_tokens = api_key, max_tokens
        self.previous: str | None = None
        self.client: openai.OpenAI | None = None

    def connect(self, base_url: str) -> None:
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key=self.api_key, max_retries=0,
                                    timeout=REQUEST_TIMEOUT_S)

    def send(self, items: list[dict[str, Any]], force_call: bool) -> Reply:
        start = time.perf_counter()
        response = self.client.responses.create(
            model=MODEL, input=[_response_item(item) for item in items], previous_response_id=self.previous,
            tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "get_weather"} if force_call else "auto",
            temperature=0, max_output_tokens=self.max_tokens)
        seconds = time.perf_counter() - start
        self.previous = response.id
        calls = [ToolCall(item.call_id, item.name, item.arguments) for item in response.output
                 if item.type == "function_call"]
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens if usage.input_tokens_details else 0
        return Reply(usage.input_tokens, usage.input_tokens - cached, usage.output_tokens, seconds,
                     response.output_text, calls)


def _response_item(item: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the Responses API's input item (a tool result is a function_call_output)."""
    if item["role"] == "tool":
        return {"type": "function_call_output", "call_id": item["tool_call_id"], "output": item["content"]}
    return {"role": item["role"], "content": item["content"]}


def run_turn(agent: ChatAgent | ResponsesAgent, turn: int, owed: list[dict[str, Any]]) -> dict[str, Any]:
    """One turn: results still owed and the user's message, then requests until the model answers in text
    (at most MAX_REQUESTS). Leaves in `owed` the results of calls the turn ended on."""
    items = [*([{"role": "system", "content": SYSTEM}] if turn == 1 else []), *owed,
             {"role": "user", "content": user_message(turn)}]
    owed.clear()
    force = turn % 2 == 1
    replies: list[Reply] = []
    start = time.perf_counter()
    while items and len(replies) < MAX_REQUESTS:
        reply = agent.send(items, force_call=force and not replies)
        replies.append(reply)
        items = [{"role": "tool", "tool_call_id": c.call_id, "content": tool_result(c)} for c in reply.calls]
    latency = time.perf_counter() - start
    owed += items
    return {"turn": turn, "forced_call": force, "requests": len(replies),
            "tool_calls": sum(len(r.calls) for r in replies),
            "prompt_tokens": replies[-1].prompt_tokens,  # the conversation's length at the turn's last request
            "prefilled_tokens": sum(r.prefilled_tokens for r in replies),
            "completion_tokens": sum(r.completion_tokens for r in replies), "latency_s": latency,
            "replies": [asdict(r) for r in replies]}


@dataclass
class KilnServer:
    """`kiln serve` (bench/servers.py), started again with the same flags after a kill."""
    extra_args: list[str]
    running: servers.Server | None = None

    def start(self) -> None:
        self.running = servers.start(extra_args=self.extra_args)

    @property
    def process(self) -> subprocess.Popen:
        return self.running.process

    @property
    def http_url(self) -> str:
        return self.running.http_url

    def stop(self) -> None:
        self.running.stop()


@dataclass
class LlamaServer:
    """llama.cpp's C++ server on loopback, the model's GGUF file, the benchmark's two threads."""
    binary: str
    model: str
    process: subprocess.Popen | None = None
    http_url: str = ""
    log: list[str] = field(default_factory=list)

    def command(self, port: int) -> list[str]:
        return [self.binary, "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(common.THREADS), "--threads-batch", str(common.THREADS),
                "--ctx-size", str(LLAMA_CTX), "--parallel", "1", "--jinja", "--chat-template-file", str(LLAMA_TEMPLATE)]

    def start(self, timeout_s: float = 300.0) -> None:
        port = servers._free_port()
        process = self.process = subprocess.Popen(self.command(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True, env=common.peer_environment())
        threading.Thread(target=lambda: self.log.extend(process.stdout), daemon=True).start()  # every start's log
        self.http_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.http_url + "/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("llama-server did not start:\n" + "".join(self.log[-40:]))
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


def llama_server_build(binary: str) -> dict[str, Any]:
    """What llama-server says it is (--version), and the ggml options of the build tree beside it, if any."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    build: dict[str, Any] = {"binary": binary, "version": (done.stdout + done.stderr).strip()}
    cache = Path(binary).resolve().parent.parent / "CMakeCache.txt"  # <build>/bin/llama-server
    if cache.is_file():
        entries = (line.partition("=") for line in cache.read_text().splitlines())
        build["cmake_options"] = {key.split(":", 1)[0]: value for key, _, value in entries
                                  if key.split(":", 1)[0] in BUILD_OPTIONS}
    return build


def responses_missing(url: str, api_key: str) -> str | None:
    """Why this Kiln server has no Responses API (its OpenAPI document lacks POST /v1/responses), or None."""
    request = urllib.request.Request(url + "/openapi.json", headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        paths = json.loads(reply.read()).get("paths", {})
    if "post" not in paths.get("/v1/responses", {}):
        return "this kiln serve has no POST /v1/responses (not in its /openapi.json)"
    return None


def run_path(path: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The whole agent on one path: a fresh server and store, SIGKILL after turn --restart-after, the same
    command again, the rest of the turns."""
    api_key = os.environ.get("KILN_API_KEY", "unused")
    if path == "llamacpp-server":
        if not args.llama_server:
            return {"status": "unavailable",
                    "reason": "no llama-server binary: pass --llama-server or set LLAMA_SERVER"}
        server: Any = LlamaServer(args.llama_server, _gguf_path())
        agent: ChatAgent | ResponsesAgent = LlamaCppAgent(api_key, {}, args.max_tokens)
    else:
        server = KilnServer(["--model", MODEL, "--snapshot-dir", str(scratch / path), *shlex.split(args.kiln_args)])
        agent = (ResponsesAgent(api_key, args.max_tokens) if path == "responses" else
                 ChatAgent(api_key, {"Kiln-Session": SESSION_NAME} if path == "kiln-session" else {}, args.max_tokens))
    started = time.perf_counter()
    server.start()
    result: dict[str, Any] = {"status": "ran", "command": list(server.process.args),
                              "start_s": time.perf_counter() - started, "turns": []}
    try:
        if path == "responses" and (reason := responses_missing(server.http_url, api_key)):
            return {"status": "unavailable", "reason": reason, "command": result["command"]}
        agent.connect(server.http_url)
        owed: list[dict[str, Any]] = []
        for turn in range(1, args.turns + 1):
            if turn == args.restart_after + 1:
                result["restart_s"] = restart(server)
                agent.connect(server.http_url)
            row = run_turn(agent, turn, owed)
            row["after_restart"] = turn > args.restart_after
            result["turns"].append(row)
            print(f"{path} turn {turn}: prefilled {row['prefilled_tokens']} of {row['prompt_tokens']}, "
                  f"{row['latency_s']:.2f} s, {row['requests']} request(s)", flush=True)
    except (openai.APIError, RuntimeError) as error:
        result |= {"status": "failed", "reason": f"{type(error).__name__}: {error}"}
    finally:
        server.stop()
    result["summary"] = summarize(result["turns"], args.restart_after)
    return result


def restart(server: KilnServer | LlamaServer) -> float:
    """SIGKILL the server, start the same command again; seconds from the kill to ready."""
    start = time.perf_counter()
    server.process.kill()
    server.process.wait()
    server.start()
    return time.perf_counter() - start


def summarize(turns: list[dict[str, Any]], restart_after: int) -> dict[str, Any]:
    """Medians before the restart (turn 1 apart: every path prefills the opening), the first turn after it,
    and the medians after that."""
    phases = {"before_restart": [t for t in turns if 1 < t["turn"] <= restart_after],
              "first_after_restart": [t for t in turns if t["turn"] == restart_after + 1],
              "after_restart": [t for t in turns if t["turn"] > restart_after + 1]}
    return {f"{key}_{phase}": median(t[key] for t in rows) if rows else None
            for phase, rows in phases.items() for key in ("prefilled_tokens", "latency_s")} | {
        "prefilled_tokens_total": sum(t["prefilled_tokens"] for t in turns),
        "first_turn_prefilled_tokens": turns[0]["prefilled_tokens"] if turns else None}


def _gguf_path() -> str:
    from kiln.models.embedded import embedded_model_path

    return str(embedded_model_path(MODEL))


def plot(name: str, paths: dict[str, dict[str, Any]], restart_after: int) -> None:
    ran = {LABELS[p]: r["turns"] for p, r in paths.items() if r.get("turns")}

    def series(key: str) -> dict[str, tuple[list[float], list[float]]]:
        return {label: ([t["turn"] for t in turns], [t[key] for t in turns]) for label, turns in ran.items()}

    common.plot_line_panels(name, [("tokens prefilled per turn", series("prefilled_tokens")),
                                   ("turn latency (s, client wall time)", series("latency_s"))],
                            "turn", f"A tool-calling agent on {MODEL}, SIGKILL and restart after turn {restart_after}",
                            marks=[(restart_after + 0.5, "kill -9 + restart")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--restart-after", type=int, default=25,
                        help="SIGKILL and restart the server after this turn")
    parser.add_argument("--max-tokens", type=int, default=48, help="per reply")
    parser.add_argument("--kiln-args", default="", help='more `kiln serve` flags, e.g. --kiln-args=--durable-turns')
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                        help="llama.cpp's llama-server binary (default $LLAMA_SERVER, else on PATH)")

    def quick(args: argparse.Namespace) -> None:
        args.turns, args.restart_after = 6, 3

    args = common.parse_run_args(parser, "agents_api", "6 turns, restart after turn 3", quick)
    chosen = [p.strip() for p in args.paths.split(",") if p.strip()]
    if unknown := sorted(set(chosen) - set(PATHS)):
        raise SystemExit(f"unknown path(s) {', '.join(unknown)}; choose from {', '.join(PATHS)}")
    common.warn_if_busy()
    machine = common.machine_info()
    versions = {"openai": importlib.metadata.version("openai"),
                "llama_server": llama_server_build(args.llama_server) if args.llama_server else None}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-agents-api-") as scratch:
        for path in chosen:
            results[path] = run_path(path, args, Path(scratch))
            print(path, results[path]["status"], results[path].get("reason") or results[path].get("summary"), flush=True)
    payload = {"benchmark": "agents_api", "method": __doc__, "settings": vars(args), "machine": machine,
               "versions": versions, "model": MODEL, "gguf": _gguf_path(), "paths": results}
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, results, args.restart_after)


if __name__ == "__main__":
    main()
