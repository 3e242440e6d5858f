"""llama.cpp's side of bench/models.py and bench/gguf_sizes.py, runnable by any Python that has llama-cpp-python and numpy (no
torch, no Kiln): llama.cpp usually lives in a venv of its own, built for the host.

`python bench/llama_cpp_peer.py < request.json > answer.json`, or `answer(request)` in process. Requests:

- {"op": "quantize", "source": F16 GGUF, "target": path, "ftype": "Q4_K_M"}: llama-quantize's
  llama_model_quantize, as a user makes a Q4_K_M file;
- {"op": "score", "model": GGUF, "ppl_tokens": ids, "chunk": n, "prompts": [ids...], "max_tokens": n}: the
  perplexity of ppl_tokens[1:] given their prefixes (one causal pass, `chunk` tokens per llama_decode, every
  position's logits) and the greedy continuation of each prompt, on llama.cpp's own kernels with its
  default f16 KV cache;
- {"op": "speed", "model": GGUF, "decode_prompt": ids, "decode_tokens": n, "decode_repeats": n,
  "prefill_prompts": {length: [ids...]}}: batch-1 greedy decode tokens/s after the first token (one untimed
  warm-up, then `decode_repeats` runs), prefill tokens/s of each prompt (the first of each length untimed),
  the process's memory after; llama-cpp-python's `Llama.eval` as its users call it (n_batch taking the
  longest prompt in one call, llama.cpp's default n_ubatch and f16 KV cache);
- {"op": "build"}: the llama-cpp-python version and what its ggml was built with.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

THREADS = 2  # bench/common.py THREADS: every system gets the same two threads
_CTX_ALIGN = 256
_N_BATCH = 2048  # llama.cpp's default logical batch (llama-cli, llama-server)


def answer(request: dict[str, Any]) -> dict[str, Any]:
    ops = {"quantize": quantize, "score": score, "speed": speed, "build": build}
    return ops[request.pop("op")](**request)


def build() -> dict[str, Any]:
    import llama_cpp

    return {
        "llama_cpp_python": llama_cpp.__version__,
        "cmake_args": os.environ.get("CMAKE_ARGS") or None,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def quantize(source: str, target: str, ftype: str) -> dict[str, Any]:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = THREADS
    code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if code != 0:
        raise RuntimeError(f"llama_model_quantize returned {code}")
    return {"target": target}


def score(model: str, ppl_tokens: list[int], chunk: int, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from llama_cpp import Llama

    longest = max(len(ppl_tokens), *(len(p) + max_tokens for p in prompts))
    llama = Llama(model_path=model, n_ctx=-(-longest // _CTX_ALIGN) * _CTX_ALIGN, n_batch=chunk, n_ubatch=chunk,
                  n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    decoder = _Decoder(llama, chunk)
    nll = 0.0
    for start in range(0, len(ppl_tokens) - 1, chunk):
        logits = decoder.logits(ppl_tokens[start : start + chunk], start)
        targets = np.array(ppl_tokens[start + 1 : start + 1 + len(logits)])
        logits = logits[: len(targets)].astype(np.float64)
        top = logits.max(axis=1)
        log_norm = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll += float((log_norm - logits[np.arange(len(targets)), targets]).sum())
    greedy = [decoder.greedy(prompt, max_tokens) for prompt in prompts]
    decoder.close()
    llama.close()
    return {"perplexity": math.exp(nll / (len(ppl_tokens) - 1)), "greedy": greedy}


def speed(model: str, decode_prompt: list[int], decode_tokens: int, decode_repeats: int,
          prefill_prompts: dict[str, list[list[int]]]) -> dict[str, Any]:
    from llama_cpp import Llama, llama_get_logits_ith

    longest = max([len(decode_prompt) + decode_tokens, *(len(p) for prompts in prefill_prompts.values() for p in prompts)])
    settings = {"n_ctx": -(-longest // _CTX_ALIGN) * _CTX_ALIGN, "n_batch": max(_N_BATCH, longest), "n_threads": THREADS,
                "n_threads_batch": THREADS}
    start = time.perf_counter()
    llama = Llama(model_path=model, **settings, verbose=False)
    ready = time.perf_counter() - start
    vocab = llama.n_vocab()

    def evaluate(tokens: list[int]) -> int:
        """Append `tokens` to the context; the greedy next token."""
        llama.eval(tokens)
        pointer = ctypes.cast(llama_get_logits_ith(llama.ctx, -1), ctypes.POINTER(ctypes.c_float))
        return int(np.ctypeslib.as_array(pointer, shape=(vocab,)).argmax())

    def decode_rate() -> float:
        llama.reset()
        token = evaluate(decode_prompt)
        start = time.perf_counter()
        for _ in range(decode_tokens - 1):
            token = evaluate([token])
        return (decode_tokens - 1) / (time.perf_counter() - start)

    def prefill_rate(prompt: list[int]) -> float:
        llama.reset()  # forget the previous prompt: eval() then clears its KV
        start = time.perf_counter()
        evaluate(prompt)
        return len(prompt) / (time.perf_counter() - start)

    decode = [decode_rate() for _ in range(decode_repeats + 1)][1:]
    prefill = {length: [prefill_rate(p) for p in prompts][1:] for length, prompts in prefill_prompts.items()}
    answer = {"seconds_to_ready": ready, "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill,
              "memory": memory(), "settings": settings | {key: getattr(llama.context_params, key) for key in
                                                           ("n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn_type")}}
    llama.close()
    return answer


def memory() -> dict[str, int]:
    """This process's memory now in bytes, from /proc/self/status: VmRSS (RssAnon + RssFile) and its peak,
    VmHWM. A fresh process's own: a forked child's ru_maxrss starts from its parent's high-water mark."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status.read().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


class _Decoder:
    """llama_decode over one sequence through llama.cpp's C API, every position's logits kept (the
    high-level Llama keeps them all in one [n_ctx, vocab] array: gigabytes on a 262k vocabulary)."""

    def __init__(self, llama: Any, chunk: int) -> None:
        import llama_cpp

        self._api, self._ctx, self._chunk = llama_cpp, llama.ctx, chunk
        self._batch = llama_cpp.llama_batch_init(chunk, 0, 1)
        self._vocab = llama.n_vocab()

    def logits(self, tokens: list[int], start: int) -> np.ndarray:
        """[len(tokens), vocab] float32 logits of `tokens` at positions start.. (a copy)."""
        batch = self._batch
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(tokens)
        if (code := self._api.llama_decode(self._ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {code}")
        pointer = ctypes.cast(self._api.llama_get_logits(self._ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(pointer, shape=(len(tokens), self._vocab)).copy()

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        self._api.llama_memory_clear(self._api.llama_get_memory(self._ctx), True)
        rows = np.concatenate([self.logits(prompt[i : i + self._chunk], i) for i in range(0, len(prompt), self._chunk)])
        out = [int(rows[-1].argmax())]
        while len(out) < max_tokens:
            out.append(int(self.logits(out[-1:], len(prompt) + len(out) - 1)[-1].argmax()))
        return out

    def close(self) -> None:
        self._api.llama_batch_free(self._batch)


if __name__ == "__main__":
    json.dump(answer(json.load(sys.stdin)), sys.stdout)
