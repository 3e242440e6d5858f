"""Engine: the step loop (schedule -> forward -> sample -> commit) on a background thread.

Callers submit a Request over a Sequence and get events through the request's `emit`. One lock guards
the scheduler and page tables; it is released during the model forward, so session calls never wait
more than the bookkeeping of a step. Finished stateless requests are released together at the start of
the next step (batch cleanup); session sequences keep their pages.
"""

from __future__ import annotations

import hashlib
import logging
import numbers
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kiln.config import EngineConfig
from kiln.engine.runner import ModelRunner
from kiln.engine.sampler import Sampler, SamplingParams
from kiln.engine.scheduler import ScheduledChunk, Scheduler
from kiln.engine.sequence import Event, FinishEvent, Request, Sequence, TokenEvent
from kiln.errors import InvalidArgumentError, ResourceExhaustedError, UnavailableError
from kiln.kv.cache import KVCache
from kiln.kv.layout import KVLayout
from kiln.models import build_model
from kiln.models.loader import LoadedModel

logger = logging.getLogger(__name__)

KV_POLICY = "full"
STOP_TAIL_MARGIN = 8  # characters decoded beyond what a stop-string check strictly needs


@dataclass
class EngineStats:
    """Monotonic counters (exported as metrics by the server)."""

    prefill_tokens: int = 0  # prompt tokens computed
    reused_tokens: int = 0  # prompt tokens whose K/V was already in pages when a request started
    prefix_hit_tokens: int = 0  # of those, tokens found through the prefix cache (not a session's own)
    generated_tokens: int = 0
    steps: int = 0
    requests_by_outcome: dict[str, int] = field(default_factory=dict)


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = build_model(loaded.config, dtype=config.torch_dtype, device=config.device)
        self.model.load_weights(loaded.tensors)
        layout = KVLayout.for_model(loaded.config, config.page_size)
        num_pages = config.kv_budget_bytes // layout.page_bytes(torch.empty(0, dtype=config.torch_kv_dtype).element_size())
        if num_pages < layout.num_groups:
            raise InvalidArgumentError(f"kv_budget_bytes {config.kv_budget_bytes} holds fewer pages than one token needs")
        salt = f"{loaded.fingerprint}|{config.kv_dtype or config.dtype}|{config.page_size}|{KV_POLICY}"
        self.cache = KVCache(layout, num_pages, config.torch_kv_dtype, config.device, hashlib.sha256(salt.encode()).digest())
        self.runner = ModelRunner(self.model, self.cache)
        self.sampler = Sampler()
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.stats = EngineStats()
        self.lock = threading.RLock()
        self._wake = threading.Condition(self.lock)
        self._reclaimers: list[Callable[[], bool]] = []
        self._finish_observers: list[Callable[[Request, str], None]] = []
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_batched_tokens, self._reclaim)
        self._finished: list[Request] = []
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- submission -------------------------------------------------------------------------------

    def validate_tokens(self, token_ids: Iterable[int], what: str = "token ids") -> list[int]:
        """Token ids must be integers (Python or NumPy) inside the model's vocabulary; returns them as a
        fresh list of Python ints."""
        vocab = self.model_config.vocab_size
        ids = list(token_ids)
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"{what} must be integers in [0, {vocab}); got {bad[:5]!r}")
        return [int(t) for t in ids]

    def check_request(self, num_tokens: int, params: SamplingParams) -> None:
        """Raises if a generation over `num_tokens` of history can never run: empty, no room left in the
        context, or larger than the whole KV pool."""
        if not num_tokens:
            raise InvalidArgumentError("nothing to generate from: the history is empty")
        if num_tokens >= self.max_model_len:
            raise InvalidArgumentError(
                f"history of {num_tokens} tokens leaves no room in the model's context of {self.max_model_len}"
            )
        worst = self._worst_case_pages(min(num_tokens + params.max_tokens, self.max_model_len))
        if worst > self.cache.pool.num_pages:
            raise ResourceExhaustedError(
                f"this request may need {worst} KV pages; the pool has {self.cache.pool.num_pages} "
                f"(raise kv_budget_bytes or lower max_tokens)"
            )

    def submit(self, seq: Sequence, params: SamplingParams, emit: Callable[[Event], None], keep_pages: bool) -> Request:
        """Queue a generation over `seq` (whose tokens are its prompt/history). Raises before queueing
        if it can never run: empty, longer than the context, or larger than the whole KV pool."""
        self.check_request(len(seq.tokens), params)
        stop_ids = set(self.validate_tokens(params.stop_token_ids, "stop_token_ids"))
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        request = Request(seq, params, emit, keep_pages, frozenset(stop_ids))
        with self._wake:
            if self._stopping:
                raise UnavailableError("the engine is shutting down")
            if not self.alive:
                raise UnavailableError("the engine loop stopped after an internal error (see the server log)")
            self.scheduler.add(request)
            self._ensure_thread()
            self._wake.notify()
        return request

    @property
    def alive(self) -> bool:
        """False once the loop thread died: nothing would ever run a new request."""
        return self._thread is None or self._thread.is_alive() or self._stopping

    def cancel(self, request: Request) -> None:
        request.cancelled.set()
        with self._wake:
            self._wake.notify()

    def add_reclaimer(self, reclaim: Callable[[], bool]) -> None:
        """Register a way to free pages under pressure (e.g. evict the LRU idle session); it returns
        True when it freed something. Called with the engine lock held."""
        self._reclaimers.append(reclaim)

    def add_finish_observer(self, observe: Callable[[Request, str], None]) -> None:
        """Called on the engine thread with each request and its finish reason (metrics use it)."""
        self._finish_observers.append(observe)

    def _reclaim(self) -> bool:
        return any(reclaim() for reclaim in self._reclaimers)

    def _worst_case_pages(self, num_tokens: int) -> int:
        pages = -(-num_tokens // self.config.page_size)
        total = 0
        for group in self.cache.layout.groups:
            if group.window is None:
                total += pages
            else:
                span = group.window + self.config.max_batched_tokens + self.config.page_size
                total += min(pages, -(-span // self.config.page_size) + 1)
        return total

    # ---- the loop ---------------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not (self.scheduler.has_work() or self._finished):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # a bug in a step fails the requests in flight, never the engine
                logger.exception("engine step failed; failing the requests in flight")
                with self.lock:
                    self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), error)

    def shutdown(self) -> None:
        """Cancel everything in flight and stop the loop thread."""
        with self._wake:
            for request in list(self.scheduler.running) + list(self.scheduler.waiting):
                self.scheduler.remove(request)
                self._finish(request, "cancelled")
            self._release_finished()
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()

    def step(self) -> None:
        """One scheduler step. Safe to call directly when no loop thread runs (tests)."""
        with self.lock:
            self._release_finished()
            self._drop_cancelled()
            chunks = self.scheduler.schedule()
            for request, error in self.scheduler.failed:
                self._finish(request, "error", error=error)
            self.scheduler.failed.clear()
            if not chunks:
                return
            slices = [
                self.runner.slice_for(c.request.seq.tokens, c.request.seq.num_computed, c.num_tokens, c.request.seq.table.pages)
                for c in chunks
            ]
            sampling = [i for i, c in enumerate(chunks) if c.num_tokens == c.request.seq.uncomputed]
        try:
            logits = self.runner.run(slices, sampling)
        except Exception as error:  # a failed forward fails its requests, never the engine
            with self.lock:
                self._fail([chunk.request for chunk in chunks], error)
            return
        with self.lock:
            self._commit(chunks, sampling, logits)

    def _commit(self, chunks: list[ScheduledChunk], sampling: list[int], logits: torch.Tensor | None) -> None:
        self.stats.steps += 1
        for chunk in chunks:
            seq = chunk.request.seq
            prompt_part = max(0, min(chunk.num_tokens, chunk.request.prompt_tokens - seq.num_computed))
            self.stats.prefill_tokens += prompt_part
            seq.num_computed += chunk.num_tokens
            self.cache.commit(seq.table, seq.tokens, seq.num_computed)
        if logits is None:
            return
        requests = [chunks[i].request for i in sampling]
        for request, sampled in zip(requests, self._sample(logits, requests), strict=True):
            if request.cancelled.is_set():
                self.scheduler.remove(request)
                self._finish(request, "cancelled")
            elif isinstance(sampled, Exception):
                self._fail([request], sampled)
            else:
                self._accept(request, *sampled)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, float | None] | Exception]:
        """(token, logprob or None) per request. Should sampling the batch fail (a bug), each row is
        sampled alone, so only the request whose sampling fails fails."""
        try:
            return self._sample_rows(logits, requests)
        except Exception:
            logger.exception("sampling a batch failed; sampling its rows one by one")
        sampled: list[tuple[int, float | None] | Exception] = []
        for row, request in enumerate(requests):
            try:
                sampled += self._sample_rows(logits[row : row + 1], [request])
            except Exception as error:
                sampled.append(error)
        return sampled

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[tuple[int, float | None]]:
        token_ids, logprobs = self.sampler.sample(logits, [r.params for r in requests], [r.request_id for r in requests])
        return [(token, logprobs[row] if logprobs and request.params.logprobs else None)
                for row, (token, request) in enumerate(zip(token_ids, requests, strict=True))]

    def _accept(self, request: Request, token: int, logprob: float | None) -> None:
        request.seq.tokens.append(token)
        request.generated.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        self.stats.generated_tokens += 1
        request.emit(TokenEvent(token, logprob))
        reason, stop_string = self._stop_reason(request, token)
        if reason:
            self.scheduler.remove(request)
            self._finish(request, reason, stop_string=stop_string)

    def _stop_reason(self, request: Request, token: int) -> tuple[str | None, str | None]:
        params = request.params
        if token in request.stop_token_ids:
            return "stop", None
        if params.stop and (stop := self._stop_string_at_end(request.generated, params.stop)):
            return "stop", stop
        if len(request.generated) >= params.max_tokens or len(request.seq.tokens) >= self.max_model_len:
            return "length", None
        return None, None

    def _stop_string_at_end(self, generated: list[int], stops: tuple[str, ...]) -> str | None:
        """A stop string in the text's tail. Earlier steps checked everything before the newest token,
        so only enough trailing tokens to hold the longest stop string next to the newest token's text
        are decoded: each step costs O(stop length), not O(reply length). The margin absorbs what
        decoding from mid-text changes at the tail's left edge (a split character, a leading space)."""
        need = max(map(len, stops)) + len(self.tokenizer.decode(generated[-1:])) + STOP_TAIL_MARGIN
        count = need
        while True:
            tail = self.tokenizer.decode(generated[-count:])
            if len(tail) >= need or count >= len(generated):
                break
            count *= 2  # tokens that decode to little (special, partial bytes): widen until it holds
        return next((stop for stop in stops if stop in tail), None)

    def _finish(self, request: Request, reason: str, stop_string: str | None = None, error: Exception | None = None) -> None:
        if not request.prompt_tokens:
            request.prompt_tokens = len(request.seq.tokens) - len(request.generated)
            request.reused_tokens = request.seq.num_computed
        self.stats.reused_tokens += request.reused_tokens
        self.stats.prefix_hit_tokens += request.prefix_hit_tokens
        for observe in self._finish_observers:
            observe(request, reason)
        self.stats.requests_by_outcome[reason] = self.stats.requests_by_outcome.get(reason, 0) + 1
        self.sampler.forget(request.request_id)
        if not request.keep_pages:
            self._finished.append(request)
        request.emit(FinishEvent(reason, request.usage(), stop_string, error))

    def _fail(self, requests: list[Request], error: Exception) -> None:
        """End requests with an error, dropping pages allocated past what they computed."""
        for request in requests:
            self.cache.truncate(request.seq.table, request.seq.num_computed)
            self.scheduler.remove(request)
            self._finish(request, "error", error=error)

    def _drop_cancelled(self) -> None:
        for request in [r for r in list(self.scheduler.running) + list(self.scheduler.waiting) if r.cancelled.is_set()]:
            self.scheduler.remove(request)
            self._finish(request, "cancelled")

    def _release_finished(self) -> None:
        for request in self._finished:
            self.cache.release(request.seq.table)
            request.seq.num_computed = 0
        self._finished.clear()
