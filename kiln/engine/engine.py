"""Engine: the step loop (schedule -> forward -> sample -> commit) on a background thread, and the narrow
API everything outside kiln/engine and kiln/kv uses: submit, cancel, stats, and the page-facing
operations on session sequences (new, fork, append, check, release, resident K/V).

Lock discipline: one lock guards the scheduler, the KV cache and the sequences' page state, and is held
only for that bookkeeping. The forward, sampling, stop-string decoding and every emit callback run
without it, so a session call never waits longer than a step's bookkeeping, and callbacks may call back
into the engine. A step in flight owns the page tables it read: shutdown waits for it before releasing
anything, and an engine still alive at interpreter exit is shut down then.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate

import torch

from kiln.config import EngineConfig
from kiln.engine.constraints import Matcher, compiler_for, constrain
from kiln.engine.runner import Chunk, ModelRunner
from kiln.engine.sampler import Sampler, SamplingParams, top_logprobs
from kiln.engine.scheduler import ScheduledChunk, Scheduler
from kiln.engine.sequence import Event, FinishEvent, Request, Sequence, TokenEvent
from kiln.engine.speculative import NgramProposer, verify
from kiln.engine.stats import EngineStats
from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolation,
    ResourceExhaustedError,
    UnavailableError,
)
from kiln.kv.cache import KVCache, PoolUsage
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat, dtype_name
from kiln.kv.image import KVImage, PageKey
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable
from kiln.kv.policy import KVPolicy
from kiln.kv.tiers import PageTiers, TierUsage
from kiln.models import build_model, quantize_model
from kiln.models.loader import LoadedModel
from kiln.models.quant import quantized_file

logger = logging.getLogger(__name__)

STOP_TAIL_MARGIN = 8  # characters decoded beyond what a stop-string check strictly needs
Finished = tuple[Request, FinishEvent]
Sampled = tuple[int, float | None, tuple[tuple[int, float], ...] | None]  # token, its logprob, top alternatives


@dataclass(frozen=True)
class SequenceKV:
    """What of a sequence's K/V is resident: tokens[:resident_tokens] need no recompute."""

    resident_tokens: int
    resident_pages: int
    resident_bytes: int
    policy: KVPolicy
    tier_bytes: dict[str, int]  # the sequence's pages in each tier (shared pages counted in full)
    global_bytes: int  # of resident_bytes, the global-attention layers' pages: what the policy bounds


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model = build_model(loaded.config, dtype=config.torch_dtype, device=config.device)
        self.model.load_weights(loaded.tensors)
        quantized = config.quantization
        cache_file = quantized_file(loaded.cache_entry, quantized) if loaded.cache_entry and quantized else None
        quantize_model(self.model, quantized, batch_invariant=config.deterministic, cache_file=cache_file)
        fused = config.fused_kernels
        if fused:
            self.model.use_kernels()
        layout = KVLayout.for_model(loaded.config, config.page_size)
        kv_dtype = config.torch_kv_dtype
        codec = KVCodec(config.kv_codec, layout, kv_dtype)
        num_pages = config.kv_budget_bytes // codec.page_nbytes
        if num_pages < layout.num_groups:
            raise InvalidArgumentError(f"kv_budget_bytes {config.kv_budget_bytes} holds fewer pages than one token needs")
        # K/V bits depend on how the weights are stored and on the kernels (batch-invariant or BLAS).
        weights = f"{dtype_name(config.torch_dtype)}/{quantized or 'exact'}" + ("/deterministic" if config.deterministic else "")
        if fused:
            weights += "/fused"
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.default_policy = self.policy()
        tiers = PageTiers(codec, config.kv_host_budget_mb * 2**20, config.kv_disk_dir, config.kv_disk_budget_mb * 2**20)
        kv_format = KVFormat(loaded.fingerprint, weights, dtype_name(kv_dtype), codec.encoding, config.page_size)
        self._cache = KVCache(layout, num_pages, codec, config.device, kv_format, tiers)
        stream_pages = -(-config.kv_stream_chunk_tokens // config.page_size)
        self._runner = ModelRunner(self.model, self._cache.storage, config.deterministic, tiers, stream_pages)
        self._sampler = Sampler()
        self._proposer = NgramProposer(config.num_speculative_tokens) if config.speculative == "ngram" else None
        self._constraints = compiler_for(loaded.fingerprint, loaded.tokenizer, loaded.config.vocab_size)
        self.stats = EngineStats()
        self._lock = threading.RLock()  # reentrant: a stream collected on the engine thread cancels itself
        self._wake = threading.Condition(self._lock)
        self._finish_observers: list[Callable[[Request, str], None]] = []
        self._scheduler = Scheduler(
            self._cache, config.max_num_seqs, config.max_batched_tokens, config.prefill_chunk_tokens, self.stats,
            self._propose,
        )
        self._finished: list[Request] = []  # stateless requests whose pages the next step releases
        self._thread: threading.Thread | None = None
        self._stopping = False
        _live_engines.add(self)

    # ---- what the engine holds ----------------------------------------------------------------------

    @property
    def kv_page_bytes(self) -> int:
        return self._cache.page_bytes

    @property
    def kv_pages(self) -> int:
        return self._cache.num_pages

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs while every layer keeps it (sliding-window layers later release it)."""
        return int(self._cache.storage.codec.bytes_per_token() * self._cache.layout.num_groups)

    @property
    def kv_format(self) -> KVFormat:
        return self._cache.format

    @property
    def kv_layout(self) -> KVLayout:
        return self._cache.layout

    def kv_usage(self) -> PoolUsage:
        with self._lock:
            return self._cache.usage()

    def tier_usage(self) -> TierUsage:
        with self._lock:
            return self._cache.tiers.usage()  # type: ignore[union-attr]

    @property
    def tier_bytes_per_token(self) -> float:
        """Bytes one token costs in a tier, every global layer (the only ones tiers hold): the pool's
        encoding, moved as it is."""
        global_groups = sum(group.window is None for group in self._cache.layout.groups)
        return self._cache.tiers.codec.bytes_per_token() * global_groups  # type: ignore[union-attr]

    def policy(self, name: str | None = None, sink_tokens: int | None = None, window_tokens: int | None = None) -> KVPolicy:
        """A validated KV policy: the engine's configured one where an argument is None."""
        config = self.config
        name = config.kv_policy if name is None else name
        if name == "restore" and config.deterministic:
            raise InvalidArgumentError("kv_policy 'restore' is not available in the deterministic mode", "kv_policy")
        return KVPolicy.create(
            name,
            config.kv_sink_tokens if sink_tokens is None else sink_tokens,
            config.kv_window_tokens if window_tokens is None else window_tokens,
            config.page_size,
            self.max_model_len,
        )

    def pending(self) -> int:
        """Requests queued or running."""
        with self._lock:
            return len(self._scheduler.waiting) + len(self._scheduler.running)

    @property
    def alive(self) -> bool:
        """False once the loop thread died: nothing would ever run a new request."""
        return self._thread is None or self._thread.is_alive() or self._stopping

    # ---- input checks -------------------------------------------------------------------------------

    def validate_tokens(self, token_ids: Iterable[int], what: str = "token ids") -> list[int]:
        """Token ids must be integers (Python or NumPy) inside the model's vocabulary; returns them as a
        fresh list of Python ints. A `what` that is a field name is the error's param."""
        vocab = self.model_config.vocab_size
        ids = list(token_ids)
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidArgumentError(f"{what} must be integers in [0, {vocab}); got {bad[:5]!r}",
                                       what if what.isidentifier() else None)
        return [int(t) for t in ids]

    def check_request(self, num_tokens: int, params: SamplingParams, policy: KVPolicy | None = None) -> None:
        """Raises if a generation over `num_tokens` of history can never run: empty, no room left in the
        context, larger than the whole KV pool, or a constraint that does not compile (compiled here, in
        the caller's thread, and cached: the engine thread never compiles)."""
        if not num_tokens:
            raise InvalidArgumentError("nothing to generate from: the history is empty")
        if num_tokens >= self.max_model_len:
            raise InvalidArgumentError(
                f"history of {num_tokens} tokens leaves no room in the model's context of {self.max_model_len}"
            )
        worst = self._worst_case_pages(min(num_tokens + params.max_tokens, self.max_model_len), policy or self.default_policy)
        if worst > self._cache.num_pages:
            raise ResourceExhaustedError(
                f"this request may need {worst} KV pages; the pool has {self._cache.num_pages} "
                f"(raise kv_budget_bytes or lower max_tokens)"
            )
        self.validate_tokens((token for token, _ in params.logit_bias), "logit_bias")
        if params.constraint is not None:
            self._constraints.compile(params.constraint)

    def _worst_case_pages(self, num_tokens: int, policy: KVPolicy) -> int:
        """Most pages a sequence of `num_tokens` holds at once: a window group its window plus a step's
        tokens; a global group everything, or under a bounded policy its resident set plus a step's
        tokens (restore's evicted pages are in a tier, or stay resident when no tier has room)."""
        pages = -(-num_tokens // self.config.page_size)
        step_pages = -(-(self.config.max_batched_tokens + self.config.page_size) // self.config.page_size)
        bounded = policy.resident_limit(self.config.page_size)
        total = 0
        for group in self._cache.layout.groups:
            if group.window is None:
                total += pages if bounded is None else min(pages, bounded + step_pages)
            else:
                span = group.window + self.config.max_batched_tokens + self.config.page_size
                total += min(pages, -(-span // self.config.page_size) + 1)
        return total

    # ---- sequences ----------------------------------------------------------------------------------

    def new_sequence(self, token_ids: Iterable[int], session: bool, policy: KVPolicy | None = None) -> Sequence:
        """A sequence over validated token ids, holding no pages yet, under `policy` (default: the
        engine's), fixed for its life."""
        table = PageTable.empty(self._cache.layout.num_groups, policy or self.default_policy)
        return Sequence(self.validate_tokens(token_ids), table, session)

    def fork_sequence(self, parent: Sequence, at: int) -> Sequence:
        """A session sequence whose history is parent.tokens[:at], sharing the parent's pages."""
        with self._lock:
            table, computed = self._cache.fork(parent.table, parent.num_computed, parent.tokens[:at])
            child = Sequence(parent.tokens[:at], table, session=True, num_computed=computed)
            self._scheduler.park(child)
            return child

    def append(self, seq: Sequence, token_ids: list[int]) -> None:
        """Extend an idle session sequence's history (validated ids); the next generate prefills them."""
        with self._lock:
            seq.tokens.extend(token_ids)
            self._scheduler.park(seq)

    def check_sequence(self, seq: Sequence) -> None:
        """INV-1 on an idle sequence: its pages agree with its tokens (raises InvariantViolation)."""
        with self._lock:
            self._cache.check(seq.table, seq.tokens, seq.num_computed)

    def sequence_kv(self, seq: Sequence) -> SequenceKV:
        with self._lock:
            pages = len(seq.table.resident())
            layout = self._cache.layout
            global_pages = sum(page is not None for group, table in zip(layout.groups, seq.table.pages, strict=True)
                               if group.window is None for page in table)
            tiers = self._cache.tiers
            tier_bytes = dict.fromkeys(("host", "disk"), 0)
            for g, indices in enumerate(seq.table.tiered):
                for i in indices:
                    tier_bytes[tiers.tier_of((g, seq.table.hashes[i]))] += tiers.codec.page_nbytes  # type: ignore[union-attr]
            page_bytes = self._cache.page_bytes
            return SequenceKV(seq.num_computed, pages, pages * page_bytes, seq.table.policy, tier_bytes, global_pages * page_bytes)

    def capture_sequence(self, seq: Sequence, known: dict[PageKey, int]) -> KVImage:
        """A copy of an idle session sequence's K/V, taken between steps (see KVCache.capture for
        `known`). FailedPreconditionError while a request runs on it: its pages are being written."""
        with self._lock:
            if any(r.seq is seq for r in (*self._scheduler.waiting, *self._scheduler.running)):
                raise FailedPreconditionError("a generation is running on this sequence")
            return self._cache.capture(seq.table, seq.tokens, seq.num_computed, known)

    def load_sequence(self, image: KVImage) -> Sequence:
        """A session sequence over an image's tokens holding its K/V (checked by the caller against this
        engine's format). If the pool cannot hold the pages now, the history alone: the next turn
        recomputes the K/V, as after memory pressure."""
        with self._lock:
            table = self._cache.load(image)
            computed = image.num_computed if table is not None else 0
            if table is None:
                table = PageTable.empty(self._cache.layout.num_groups, image.policy)
            seq = Sequence(list(image.tokens), table, session=True, num_computed=computed)
            self._scheduler.park(seq)
            return seq

    def release_sequence(self, seq: Sequence) -> None:
        """The sequence's owner is done with it: pages go back now, or when its running request ends."""
        with self._lock:
            seq.closed = True
            if any(r.seq is seq for r in (*self._scheduler.waiting, *self._scheduler.running)):
                return
            self._scheduler.unpark(seq)
            self._cache.release(seq.table)
            seq.num_computed = 0

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, seq: Sequence, params: SamplingParams, emit: Callable[[Event], None]) -> Request:
        """Queue a generation over `seq` (whose tokens are its prompt/history). Raises before queueing
        if it can never run: empty, longer than the context, or larger than the whole KV pool."""
        self.check_request(len(seq.tokens), params, seq.table.policy)
        stop_ids = set(self.validate_tokens(params.stop_token_ids, "stop_token_ids"))
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        stop_ids = frozenset(stop_ids)
        matcher = None if params.constraint is None else self._constraints.matcher(params.constraint, stop_ids)
        request = Request(seq, params, emit, stop_ids, matcher)
        with self._wake:
            if self._stopping:
                raise UnavailableError("the engine is shutting down")
            if not self.alive:
                raise UnavailableError("the engine loop stopped after an internal error (see the server log)")
            self._scheduler.add(request)
            self._ensure_thread()
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a generation; its finish event ("cancelled") follows from the engine thread."""
        request.cancelled.set()
        with self._wake:
            self._wake.notify()

    def add_finish_observer(self, observe: Callable[[Request, str], None]) -> None:
        """Called on the engine thread, without the engine lock, with each request and its finish
        reason (metrics use it)."""
        self._finish_observers.append(observe)

    # ---- the loop -----------------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not (self._scheduler.has_work() or self._finished):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as error:  # a bug in a step fails the requests in flight, never the engine
                logger.exception("engine step failed; failing the requests in flight")
                with self._lock:
                    ended = self._fail([*self._scheduler.running, *self._scheduler.waiting], error)
                self._emit(ended)

    def shutdown(self) -> None:
        """Stop the loop (after the step in flight, whose forward still writes pages), then cancel
        everything queued or running and release stateless requests' pages."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            ended = [self._finish(r, "cancelled") for r in [*self._scheduler.running, *self._scheduler.waiting]]
            self._release_finished()
        self._emit(ended)
        _live_engines.discard(self)

    def step(self) -> None:
        """One scheduler step. Safe to call directly when no loop thread runs (tests)."""
        with self._lock:
            self._release_finished()
            ended = self._drop_cancelled()
            chunks = self._scheduler.schedule()
            ended += [self._finish(r, "error", error=e) for r, e in self._scheduler.failed]
            self._scheduler.failed.clear()
            inputs = self._runner.prepare([Chunk(c.request.seq, c.num_tokens, int(c.samples) + len(c.draft), c.draft) for c in chunks]) if chunks else None
        self._emit(ended)
        if inputs is None:
            return
        sampling = [c for c in chunks if c.samples]
        try:
            logits = self._runner.run(inputs)
        except Exception as error:  # a failed forward fails its requests, never the engine
            with self._lock:
                ended = self._fail([c.request for c in chunks], error)
            self._emit(ended)
            return
        self.stats.note_step_attention(inputs.attention.kv.peak_bytes)
        with self._lock:
            self._commit(chunks)
        if logits is not None:
            self._emit(self._accept_all(sampling, self._sample(sampling, logits)))

    def _commit(self, chunks: list[ScheduledChunk]) -> None:
        self.stats.steps += 1
        for chunk in chunks:
            seq = chunk.request.seq
            self.stats.prefill_tokens += max(0, min(chunk.num_tokens, chunk.request.prompt_tokens - seq.num_computed))
            seq.num_computed += chunk.num_tokens - len(chunk.draft)  # a draft's rows count once accepted
            self._cache.commit(seq.table, seq.tokens, seq.num_computed)

    def _accept_all(self, chunks: list[ScheduledChunk], sampled: list[list[Sampled] | Exception]) -> list[Finished]:
        """Tokens join their sequences and stream out; stop conditions are checked (all without the lock:
        a running request's tokens are the engine thread's alone). Then speculative chunks keep the K/V
        of the draft tokens that joined, and the finished requests end together."""
        endings: list[tuple[Request, str, str | None]] = []
        failures: list[tuple[Request, Exception]] = []
        appended: list[int] = []
        for chunk, result in zip(chunks, sampled, strict=True):
            request = chunk.request
            before = len(request.generated)
            if request.cancelled.is_set():
                endings.append((request, "cancelled", None))
            elif isinstance(result, Exception):
                failures.append((request, result))
            else:
                for token, logprob, top in result:
                    if request.matcher is not None and not request.matcher.accept(token):  # only a bug gets here
                        failures.append((request, InvariantViolation("constraint", f"sampled token {token} outside the mask")))
                        break
                    reason, stop_string = self._accept(request, token, logprob, top)
                    if reason:
                        endings.append((request, reason, stop_string))
                        break
            appended.append(len(request.generated) - before)
        with self._lock:
            for chunk, count, result in zip(chunks, appended, sampled, strict=True):
                if chunk.draft:
                    self._settle_draft(chunk, count, 0 if isinstance(result, Exception) else len(result) - 1)
            ended = [self._finish(r, reason, stop_string) for r, reason, stop_string in endings]
            return ended + [finished for r, error in failures for finished in self._fail([r], error)]

    def _settle_draft(self, chunk: ScheduledChunk, appended: int, accepted: int) -> None:
        """After a speculative step: draft rows whose tokens joined the sequence keep their K/V, except
        the last token appended, which stays uncomputed as after any decode step; the rest rolls back."""
        seq = chunk.request.seq
        seq.num_computed = self._cache.drop(seq.table, seq.num_computed + max(0, appended - 1))
        self._cache.commit(seq.table, seq.tokens, seq.num_computed)
        self.stats.spec_verify_steps += 1
        self.stats.spec_proposed_tokens += len(chunk.draft)
        self.stats.spec_accepted_tokens += accepted
        if self._proposer is not None:
            self._proposer.feedback(chunk.request, len(chunk.draft), accepted)

    def _propose(self, request: Request, limit: int) -> list[int]:
        """A draft for a decode row, none past max_tokens or the context. Under a constraint the grammar
        checks the draft at verification (_mask_draft_rows)."""
        if self._proposer is None:
            return []
        room = min(limit, request.params.max_tokens - len(request.generated) - 1, self.max_model_len - len(request.seq.tokens) - 1)
        return self._proposer.propose(request, room)

    def _sample(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> list[list[Sampled] | Exception]:
        """Each sampling chunk's tokens: one sampled from its row, or a draft's verified prefix plus one.
        A failure fails only its request."""
        starts = list(accumulate([0, *(1 + len(c.draft) for c in chunks)]))
        plain = [i for i, c in enumerate(chunks) if not c.draft]
        results: list[list[Sampled] | Exception] = [[] for _ in chunks]
        if plain:
            # Every row a plain chunk's (no drafts in the step): the logits as they are, no 1 MB-per-row copy.
            rows = logits if len(plain) == len(logits) else logits[[starts[i] for i in plain]]
            sampled = self._sample_plain(rows, [chunks[i].request for i in plain])
            for i, result in zip(plain, sampled, strict=True):
                results[i] = result if isinstance(result, Exception) else [result]
        for i, chunk in enumerate(chunks):
            if chunk.draft:
                try:
                    results[i] = self._verify(chunk, logits[starts[i] : starts[i + 1]])
                except Exception as error:
                    logger.exception("verifying a draft failed")
                    results[i] = error
        return results

    def _verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> list[Sampled]:
        request, params = chunk.request, chunk.request.params
        rows = constrain(rows, [None] * len(rows), [params.logit_bias] * len(rows))
        if request.matcher is not None:
            rows = self._mask_draft_rows(request.matcher, rows, chunk.draft)
        tokens = verify(rows, chunk.draft, params, self._sampler, request.request_id)
        rows = rows[: len(tokens)]
        logprobs = torch.log_softmax(rows, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist() if params.logprobs else None
        tops = top_logprobs(rows, [params.top_logprobs] * len(tokens))
        return [(token, logprobs[i] if logprobs else None, tops[i]) for i, token in enumerate(tokens)]

    @staticmethod
    def _mask_draft_rows(matcher: Matcher, rows: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """Row i of a draft's logits masked by the grammar as it stands after the draft's first i tokens.
        A draft token the grammar refuses is masked out of its row, so verification rejects it there and
        never reads the rows after it (left unmasked). The matcher ends as it began: the accepted tokens
        advance it again when they join the sequence."""
        rows = rows.clone()
        advanced = 0
        for i in range(len(rows)):
            rows[i : i + 1] = constrain(rows[i : i + 1], [matcher], [()])
            if i == len(draft) or not matcher.accept(draft[i]):
                break
            advanced += 1
        matcher.rollback(advanced)
        return rows

    def _sample_plain(self, logits: torch.Tensor, requests: list[Request]) -> list[Sampled | Exception]:
        """(token, logprob or None, top alternatives or None) per request. Should sampling the batch fail
        (a bug), each row is sampled alone, so only the request whose sampling fails fails."""
        try:
            return self._sample_rows(logits, requests)
        except Exception:
            logger.exception("sampling a batch failed; sampling its rows one by one")
        sampled: list[Sampled | Exception] = []
        for row, request in enumerate(requests):
            try:
                sampled += self._sample_rows(logits[row : row + 1], [request])
            except Exception as error:
                sampled.append(error)
        return sampled

    def _sample_rows(self, logits: torch.Tensor, requests: list[Request]) -> list[Sampled]:
        logits = constrain(logits, [r.matcher for r in requests], [r.params.logit_bias for r in requests])
        token_ids, logprobs = self._sampler.sample(logits, [r.params for r in requests], [r.request_id for r in requests])
        tops = top_logprobs(logits, [r.params.top_logprobs for r in requests])
        return [(token, logprobs[row] if logprobs and request.params.logprobs else None, tops[row])
                for row, (token, request) in enumerate(zip(token_ids, requests, strict=True))]

    def _accept(self, request: Request, token: int, logprob: float | None,
                top: tuple[tuple[int, float], ...] | None) -> tuple[str | None, str | None]:
        request.seq.tokens.append(token)
        request.generated.append(token)
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        self.stats.generated_tokens += 1
        request.emit(TokenEvent(token, logprob, top))
        return self._stop_reason(request, token)

    def _stop_reason(self, request: Request, token: int) -> tuple[str | None, str | None]:
        params = request.params
        if token in request.stop_token_ids or (request.matcher is not None and request.matcher.is_terminated()):
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

    # ---- endings (under the lock; their events are emitted after it is released) --------------------

    def _finish(self, request: Request, reason: str, stop_string: str | None = None, error: Exception | None = None) -> Finished:
        self._scheduler.remove(request)
        if not request.prompt_tokens:
            request.prompt_tokens = len(request.seq.tokens) - len(request.generated)
            request.reused_tokens = request.seq.num_computed
        self.stats.reused_tokens += request.reused_tokens
        self.stats.prefix_hit_tokens += request.prefix_hit_tokens
        self.stats.requests_by_outcome[reason] += 1
        self._sampler.forget(request.request_id)
        seq = request.seq
        if not seq.session or seq.closed:
            self._finished.append(request)
        else:
            self._scheduler.park(seq)
        return request, FinishEvent(reason, request.usage(), stop_string, error)

    def _fail(self, requests: list[Request], error: Exception) -> list[Finished]:
        """End requests with an error, dropping pages allocated past what they computed."""
        for request in requests:
            request.seq.num_computed = self._cache.drop(request.seq.table, request.seq.num_computed)
        return [self._finish(request, "error", error=error) for request in requests]

    def _drop_cancelled(self) -> list[Finished]:
        cancelled = [r for r in (*self._scheduler.running, *self._scheduler.waiting) if r.cancelled.is_set()]
        return [self._finish(r, "cancelled") for r in cancelled]

    def _release_finished(self) -> None:
        for request in self._finished:
            self._cache.release(request.seq.table)
            request.seq.num_computed = 0
        self._finished.clear()

    def _emit(self, ended: list[Finished]) -> None:
        for request, event in ended:
            for observe in self._finish_observers:
                observe(request, event.reason)
            request.emit(event)


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    """A loop thread still inside a forward when the interpreter tears down aborts the process
    ("terminate called without an active exception"): stop every engine first."""
    for engine in list(_live_engines):
        engine.shutdown()
