"""llama.cpp's side of bench/models.py, runnable by any Python that has llama-cpp-python and numpy (no
torch, no Kiln): llama.cpp usually lives in a venv of its own, built for the host.

`python bench/llama_cpp_peer.py < request.json > answer.json`, or `answer(request)` in process. Requests:

- {"op": "quantize", "source": F16 GGUF, "target": path, "ftype": "Q4_K_M"}: llama-quantize's
  llama_model_quantize, as a user makes a Q4_K_M file;
- {"op": "score", "model": GGUF, "ppl_tokens": ids, "chunk": n, "prompts": [ids...], "max_tokens": n}: the
  perplexity of ppl_tokens[1:] given their prefixes (one causal pass, `chunk` tokens per llama_decode, every
  position's logits) and the greedy continuation of each prompt, on llama.cpp's own kernels with its
  default f16 KV cache;
- {"op": "build"}: the llama-cpp-python version and what its ggml was built with.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import sys
from typing import Any

import numpy as np

THREADS = 2  # bench/common.py THREADS: every system gets the same two threads
_CTX_ALIGN = 256


def answer(request: dict[str, Any]) -> dict[str, Any]:
    ops = {"quantize": quantize, "score": score, "build": build}
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
