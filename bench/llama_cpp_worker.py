"""llama.cpp in a process of its own for throughput.py, agents.py and long_session.py, without the OpenMP wait
policy `import kiln` sets for the benchmark's process (kiln/openmp.py): under it llama.cpp's OpenMP threads
sleep at every barrier and its decode runs about 40 % slower. Runnable by any Python that has llama-cpp-python
and numpy (no torch, no Kiln), like bench/llama_cpp_peer.py.

`python bench/llama_cpp_worker.py` holds one llama.cpp model (`open_llama`) and, when asked for, its batched
decoder (`LlamaBatchDecoder`), and answers one JSON request per stdin line with one JSON line on stdout:

- {"op": "open", "model": GGUF, "n_ctx": n, "max_seqs": n or null, "seq_len": n or null}: the model, and a
  batched decoder of `max_seqs` sequences of `seq_len` tokens unless max_seqs is null; answers the context's
  "n_ctx", "type_k" and "type_v";
- {"op": "prefill", "ids": ids}: Llama.reset then Llama.eval, a fresh prompt computed as its users do;
- {"op": "generate", "prompts": [ids...], "max_tokens": n}: LlamaBatchDecoder.generate -> "tokens";
- {"op": "start_sessions"} and {"op": "turn", "new_ids": [ids...], "max_tokens": n}: LlamaBatchDecoder's
  lockstep agent turns -> "tokens";
- {"op": "history_turn", "new_ids": ids, "max_tokens": n, "fresh": bool}: Llama.generate over one growing
  history (new_ids start it when fresh, else join it; the generated tokens join it) -> "tokens" and
  "evaluated", the tokens it passed to eval;
- {"op": "close"}: frees llama.cpp; the worker exits.

Every answer carries "cpu_s", the worker's process CPU seconds so far (all its threads); a failed request is
answered with "error" and the worker goes on. `LlamaProcess` is the benchmark's side.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

import numpy as np

THREADS = 2  # bench/common.py THREADS: every system gets the same two threads
# llama.cpp sizes its context in multiples of this many cells.
_LLAMA_CTX_ALIGN = 256
# llama.cpp's own default logical and physical batch sizes (llama-cli, llama-server).
LLAMA_N_BATCH = 2048
LLAMA_N_UBATCH = 512
# Bytes per element of the llama.cpp KV cache types we may meet (GGML_TYPE_F32, GGML_TYPE_F16).
_GGML_TYPE_BYTES = {0: 4, 1: 2}


def open_llama(path: str, n_ctx: int) -> Any:
    """A llama_cpp.Llama on `path` with room for `n_ctx` tokens and two threads for both prompt and
    generation (its default would be one thread for generation on this machine)."""
    from llama_cpp import Llama

    return Llama(
        model_path=path,
        n_ctx=_align(n_ctx),
        n_batch=LLAMA_N_BATCH,
        n_ubatch=LLAMA_N_UBATCH,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )


def _align(n: int) -> int:
    return -(-n // _LLAMA_CTX_ALIGN) * _LLAMA_CTX_ALIGN


class LlamaBatchDecoder:
    """llama.cpp's own batched decoding through its C API, as its examples/batched does: one context
    with a KV sequence per prompt, and each step decodes the next token of every sequence in a single
    llama_decode call. llama-cpp-python's high-level API decodes one sequence at a time, so this is the
    only honest way to measure llama.cpp at batch > 1. Greedy: argmax of each sequence's logits."""

    def __init__(self, llama: Any, max_seqs: int, seq_len: int) -> None:
        import llama_cpp

        self._api = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_seq_max = max_seqs
        params.n_ctx = max_seqs * _align(seq_len)  # each sequence gets n_ctx / n_seq_max cells
        params.n_batch = LLAMA_N_BATCH
        params.n_ubatch = LLAMA_N_UBATCH
        params.n_threads = params.n_threads_batch = THREADS
        self._ctx = llama_cpp.llama_init_from_model(llama.model, params)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create the batched-decoding context")
        self._batch = llama_cpp.llama_batch_init(LLAMA_N_BATCH, 0, 1)
        self._n_vocab = llama.n_vocab()
        self.max_seqs = max_seqs

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt by `max_tokens` tokens, all sequences in one batch."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)
        outputs = [[self._prefill(seq, prompt)] for seq, prompt in enumerate(prompts)]
        for step in range(1, max_tokens):
            entries = [(out[-1], len(prompt) + step - 1, seq, True) for seq, (prompt, out) in enumerate(zip(prompts, outputs, strict=True))]
            self._decode(entries)
            for row, out in enumerate(outputs):
                out.append(self._argmax(row))
        return outputs

    def start_sessions(self) -> None:
        """Forget every sequence; `turn` then grows one per agent."""
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)
        self._lengths = [0] * self.max_seqs
        self._pending: list[list[int]] = [[] for _ in range(self.max_seqs)]

    def turn(self, new_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        """One agent turn for sequences 0..len(new_ids)-1 in lockstep: every sequence's new ids (and the
        last token it generated, not yet computed) in shared llama_decode batches, then `max_tokens`
        greedy tokens of all of them, one llama_decode per step."""
        entries: list[tuple[int, int, int, bool]] = []
        last_row: dict[int, int] = {}
        for seq, ids in enumerate(new_ids):
            ids = [*self._pending[seq], *ids]
            entries += [(token, self._lengths[seq] + i, seq, i == len(ids) - 1) for i, token in enumerate(ids)]
            self._lengths[seq] += len(ids)
        outputs: list[list[int]] = [[] for _ in new_ids]
        for start in range(0, len(entries), LLAMA_N_BATCH):
            part = entries[start : start + LLAMA_N_BATCH]
            self._decode(part)
            last_row.update({seq: row for row, (_, _, seq, wants) in enumerate(part) if wants})
            for seq, row in list(last_row.items()):
                if not outputs[seq]:
                    outputs[seq].append(self._argmax(row))
            last_row.clear()
        for _ in range(1, max_tokens):
            self._decode([(out[-1], self._lengths[seq], seq, True) for seq, out in enumerate(outputs)])
            for seq, out in enumerate(outputs):
                self._lengths[seq] += 1
                out.append(self._argmax(seq))
        self._pending = [[out[-1]] for out in outputs] + self._pending[len(outputs) :]
        return outputs

    def _prefill(self, seq: int, prompt: list[int]) -> int:
        """Compute one prompt into sequence `seq`; returns its first generated token."""
        for start in range(0, len(prompt), LLAMA_N_BATCH):
            chunk = prompt[start : start + LLAMA_N_BATCH]
            last = start + len(chunk) == len(prompt)
            self._decode([(token, start + i, seq, last and i == len(chunk) - 1) for i, token in enumerate(chunk)])
        return self._argmax(-1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants logits) entries."""
        batch = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        code = self._api.llama_decode(self._ctx, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, row: int) -> int:
        pointer = self._api.llama_get_logits_ith(self._ctx, row)
        logits = np.ctypeslib.as_array(ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), shape=(self._n_vocab,))
        return int(logits.argmax())

    def close(self) -> None:
        self._api.llama_batch_free(self._batch)
        self._api.llama_free(self._ctx)


class Worker:
    """The worker's state between requests: the model, its batched decoder and `history_turn`'s history."""

    def __init__(self) -> None:
        self.llama: Any = None
        self.batched: LlamaBatchDecoder | None = None
        self.history: list[int] = []
        self.evaluated = 0

    def open(self, model: str, n_ctx: int, max_seqs: int | None, seq_len: int | None) -> dict[str, Any]:
        self.llama = open_llama(model, n_ctx)
        evaluate = self.llama.eval

        def counting_eval(tokens: list[int]) -> None:
            self.evaluated += len(tokens)
            evaluate(tokens)

        self.llama.eval = counting_eval  # generate() calls self.eval: count what it computes
        if max_seqs:
            self.batched = LlamaBatchDecoder(self.llama, max_seqs, seq_len)
        params = self.llama.context_params
        return {"n_ctx": self.llama.n_ctx(), "type_k": params.type_k, "type_v": params.type_v}

    def prefill(self, ids: list[int]) -> dict[str, Any]:
        self.llama.reset()  # forget the previous prompt: eval() then clears its KV
        self.llama.eval(ids)
        return {}

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        return {"tokens": self.batched.generate(prompts, max_tokens)}

    def start_sessions(self) -> dict[str, Any]:
        self.batched.start_sessions()
        return {}

    def turn(self, new_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
        return {"tokens": self.batched.turn(new_ids, max_tokens)}

    def history_turn(self, new_ids: list[int], max_tokens: int, fresh: bool) -> dict[str, Any]:
        """Llama.generate over the whole history, greedy; reset=True keeps the longest common token prefix
        with its previous call. The history stays here, so only the new ids cross the pipe."""
        self.history = [*([] if fresh else self.history), *new_ids]
        self.evaluated = 0
        tokens: list[int] = []
        for token in self.llama.generate(self.history, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if len(tokens) == max_tokens:
                break
        self.history += tokens
        return {"tokens": tokens, "evaluated": self.evaluated}

    def close(self) -> dict[str, Any]:
        if self.batched:
            self.batched.close()
        if self.llama:
            self.llama.close()
        return {}


def serve(requests: TextIO, answers: TextIO) -> None:
    """Answer each request line until "close" or the end of `requests`."""
    worker = Worker()
    ops = {"open": worker.open, "prefill": worker.prefill, "generate": worker.generate,
           "start_sessions": worker.start_sessions, "turn": worker.turn, "history_turn": worker.history_turn,
           "close": worker.close}
    for line in requests:
        op = None
        try:
            request = json.loads(line)
            op = request.pop("op")
            answer = ops[op](**request)
        except Exception as error:
            traceback.print_exc()
            answer = {"error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps({**answer, "cpu_s": time.process_time()}) + "\n")
        answers.flush()
        if op == "close":
            return


class LlamaWorkerError(RuntimeError):
    """The worker answered a request with an error, or exited."""


class LlamaProcess:
    """The benchmark's side of the worker: starts `python bench/llama_cpp_worker.py` in `env` (the caller's
    environment without Kiln's OpenMP policy: common.peer_environment()), opens the model and turns each
    call into a request. Callers time around the calls: a request and its answer are a line of JSON each
    way, microseconds (a millisecond for an 8k-id prompt) against calls of tens of milliseconds or more."""

    def __init__(self, python: str, env: dict[str, str], model: str, n_ctx: int, max_seqs: int | None = None,
                 seq_len: int | None = None) -> None:
        here = Path(__file__).resolve()
        self._process = subprocess.Popen([python, str(here)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         env=env, cwd=here.parent)
        self._cpu_s = 0.0
        try:
            opened = self._call("open", model=model, n_ctx=n_ctx, max_seqs=max_seqs, seq_len=seq_len)
        except BaseException:
            self.close()
            raise
        self.n_ctx: int = opened["n_ctx"]
        self._cache_types = (opened["type_k"], opened["type_v"])

    def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            self._process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self._process.stdin.flush()
            line = self._process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise LlamaWorkerError(f"the llama.cpp worker exited during {op!r} (its stderr says why)")
        answer = json.loads(line)
        self._cpu_s = answer.pop("cpu_s")
        if "error" in answer:
            raise LlamaWorkerError(f"llama.cpp worker, {op!r}: {answer['error']}")
        return answer

    def cpu_seconds(self) -> float:
        """The worker's process CPU seconds as of its last answer (it uses none while it waits for the next)."""
        return self._cpu_s

    def prefill(self, ids: list[int]) -> None:
        self._call("prefill", ids=ids)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._call("generate", prompts=prompts, max_tokens=max_tokens)["tokens"]

    def start_sessions(self) -> None:
        self._call("start_sessions")

    def turn(self, new_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
        return self._call("turn", new_ids=new_ids, max_tokens=max_tokens)["tokens"]

    def history_turn(self, new_ids: list[int], max_tokens: int, fresh: bool = False) -> tuple[list[int], int]:
        """(generated tokens, tokens passed to eval) of Worker.history_turn."""
        answer = self._call("history_turn", new_ids=new_ids, max_tokens=max_tokens, fresh=fresh)
        return answer["tokens"], answer["evaluated"]

    def kv_bytes_per_token(self, config: Any) -> int:
        """K and V of every layer (`config`: the kiln ModelConfig of the same model) at the context's
        cache types (f16 by default)."""
        per_layer = config.num_kv_heads * config.head_dim * sum(_GGML_TYPE_BYTES[t] for t in self._cache_types)
        return config.num_layers * per_layer

    def close(self) -> None:
        """Ask the worker to free llama.cpp and exit; kill it if it has not within a minute."""
        process = self._process
        try:
            if process.poll() is None:
                self._call("close")
        finally:
            with process:  # closes the pipes, then waits
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()

    def __enter__(self) -> LlamaProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    answer_stream = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # anything else printed, by Python or by C, goes to stderr
    serve(sys.stdin, answer_stream)
