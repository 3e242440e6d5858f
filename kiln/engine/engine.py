"""Engine: the step loop (schedule -> forward -> commit -> sample -> accept -> emit) on a background
thread, and the narrow API everything outside kiln/engine and kiln/kv uses: submit, cancel, stats, and
the page-facing operations on session sequences (new, fork, append, check, release, resident K/V).
Sampling a step's logits is kiln/engine/step_sampler.py; what the tokens become for the callers (stop
conditions, events, finish events) is kiln/engine/output.py; pages written behind to, and fetched from,
the persistent prefix store (`use_prefix_store`) are kiln/engine/stored_prefixes.py.

Lock discipline: one lock guards the scheduler, the KV cache and the sequences' page state, and is held
only for that bookkeeping. The forward, sampling, stop-string decoding and every emit callback run
without it, so a session call never waits longer than a step's bookkeeping, and callbacks may call back
into the engine. A step in flight owns the page tables it read: shutdown waits for it before releasing
anything, and an engine still alive at interpreter exit is shut down then.

Every accepted request ends with exactly one finish event. A step that fails fails the requests in
flight and the loop goes on; should failing them fail too, the loop dies: every open request ends with
an UnavailableError at once, every later call that needs the loop is refused with one, `alive` turns
False and the failure observers run (`kiln serve` exits non-zero on it, for a supervisor to restart it;
sessions then come back from their snapshots). See docs/architecture.md § Threads.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kiln.config import EngineConfig
from kiln.engine.constraints import compiler_for
from kiln.engine.decode_graphs import DecodeGraphs
from kiln.engine.output import Finished, Outputs, Sampled
from kiln.engine.run_ahead import LaunchedDecode, runs_ahead
from kiln.engine.runner import Chunk, ModelRunner, StepInputs
from kiln.engine.sampler import Sampler, SamplingParams
from kiln.engine.scheduler import ScheduledChunk, Scheduler
from kiln.engine.sequence import Event, FinishEvent, InFlight, Request, Sequence
from kiln.engine.speculative import NgramProposer
from kiln.engine.stats import EngineStats
from kiln.engine.step_sampler import StepSampler
from kiln.engine.stored_prefixes import PageStore, StoredPrefixes
from kiln.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
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
from kiln.models.config import ModelConfig
from kiln.models.gguf_blocks import use_file_blocks
from kiln.models.loader import LoadedModel
from kiln.models.quant import quantized_file
from kiln.openmp import warn_if_set_too_late

logger = logging.getLogger(__name__)
EMBEDDINGS = "model.embed_tokens.weight"
# The engine thread takes the GIL back after every kernel call that released it; a thread busy in Python
# (a server's event loop, Ray Serve's own threads in a fleet replica) holds it for up to the interpreter's
# switch interval first, 5 ms by default, dozens of times a step. Shorter while an engine runs
# (bench/README.md, fleet: a turn through a fleet replica 156 -> 135 ms).
ENGINE_SWITCH_INTERVAL_S = 0.0005
FailureObserver = Callable[[BaseException], None]


@dataclass(frozen=True)
class SequenceKV:
    """What of a sequence's K/V is resident: tokens[:resident_tokens] need no recompute."""

    resident_tokens: int
    resident_pages: int
    resident_bytes: int
    policy: KVPolicy
    tier_bytes: dict[str, int]  # the sequence's pages in each tier (shared pages counted in full)
    global_bytes: int  # of resident_bytes, the global-attention layers' pages: what the policy bounds
    forgotten_tokens: int = 0  # positions its attention no longer reads (Sequence.forgotten_tokens)


def build_engine_model(config: EngineConfig, loaded: LoadedModel) -> tuple[torch.nn.Module, str]:
    """The model with its weights as the config stores and computes them, and the tag naming that
    choice: K/V bits depend on how the weights are stored and on the kernels (batch-invariant or BLAS),
    so the tag is part of the KV format snapshots are checked against. Weights the kernels compute with
    are read one layer at a time (from the quantised copy in the cache when there is one), and token
    embeddings stay in their file where they serve lookups only: no float32 copy of the model is ever
    resident whole (docs/architecture.md § Memory)."""
    model = build_model(loaded.config, dtype=config.torch_dtype, device=config.device)
    kernel_weights = config.quantization is not None or config.deterministic
    table = loaded.stored_rows(EMBEDDINGS)
    mapped = model.can_map_embeddings(table, head_quantised=kernel_weights)
    skip = (model.linear_parameters() if kernel_weights else set()) | ({EMBEDDINGS} if mapped else set())
    if not kernel_weights:
        loaded.keep_converted()
    model.load_weights(loaded.tensors, skip=skip)
    if mapped:
        model.map_embeddings(table)
    in_blocks = use_file_blocks(model, loaded.tensors) if config.quantization == "gguf" else 0
    # Layers the file's blocks do not serve (all of them but for "gguf" on a GGUF file of block types) as
    # int8, cached apart when beside blocks, since the cache then holds only some layers.
    left = not in_blocks or not model.head_computes or any(isinstance(m, torch.nn.Linear) for m in model.modules())
    quantized = "int8" if config.quantization else None
    if left:
        cached = quantized and (f"{quantized}-beside-blocks" if in_blocks else quantized)
        cache_file = quantized_file(loaded.cache_entry, cached) if loaded.cache_entry and cached else None
        quantize_model(model, quantized, batch_invariant=config.deterministic, cache_file=cache_file, tensors=loaded.tensors)
    formats = ("gguf+int8" if left else "gguf") if in_blocks else quantized or "exact"
    weights = f"{dtype_name(config.torch_dtype)}/{formats}" + ("/deterministic" if config.deterministic else "")
    if config.fused_kernels:
        model.use_kernels()
        weights += "/fused"
    return model, weights


class Engine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        warn_if_set_too_late()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model, weights = build_engine_model(config, loaded)
        layout = KVLayout.for_model(loaded.config, config.page_size)
        kv_dtype = config.torch_kv_dtype
        codec = KVCodec(config.kv_codec, layout, kv_dtype)
        num_pages = config.kv_budget_bytes // codec.page_nbytes
        if num_pages < layout.num_groups:
            raise InvalidArgumentError(f"kv_budget_bytes {config.kv_budget_bytes} holds fewer pages than one token needs")
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings, loaded.config.max_position_embeddings)
        self.default_policy = self.policy()
        tiers = PageTiers(codec, config.kv_host_budget_mb * 2**20, config.kv_disk_dir, config.kv_disk_budget_mb * 2**20)
        kv_format = KVFormat(loaded.fingerprint, weights, dtype_name(kv_dtype), codec.encoding, config.page_size)
        self._cache = KVCache(layout, num_pages, codec, config.device, kv_format, tiers)
        stream_pages = -(-config.kv_stream_chunk_tokens // config.page_size)
        self._runner = ModelRunner(self.model, self._cache.storage, config.deterministic, tiers, stream_pages)
        self._decode_graphs = self._use_decode_graphs(config, loaded.config)
        self._sampler = Sampler()
        self._step_sampler = StepSampler(self._sampler)
        self._proposer = NgramProposer(config.num_speculative_tokens) if config.speculative == "ngram" else None
        self._constraints = compiler_for(loaded.fingerprint, loaded.tokenizer, loaded.config.vocab_size)
        self.stats = EngineStats()
        self._outputs = Outputs(loaded.tokenizer, self.max_model_len, self.stats)
        self._lock = threading.RLock()  # reentrant: a stream collected on the engine thread cancels itself
        self._wake = threading.Condition(self._lock)
        self._last_usage = self._cache.usage()  # what kv_usage_nowait answers while the lock is busy
        self._failure: BaseException | None = None  # why the loop died
        self._failure_observers: list[FailureObserver] = []
        self._scheduler = Scheduler(
            self._cache, config.max_num_seqs, config.max_batched_tokens, config.prefill_chunk_tokens, self.stats,
            self._propose, config.max_seqs_per_caller,
        )
        self._finished: list[Request] = []  # stateless requests whose pages the next step releases
        self._stored: StoredPrefixes | None = None  # the persistent prefix store (`use_prefix_store`)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ahead: LaunchedDecode | None = None  # a decode step launched ahead of its predecessor's tokens
        self._on_host = config.platform.on_host  # the host's Sampler draws a step's tokens (run_ahead.runs_ahead)
        _live_engines.add(self)

    def _use_decode_graphs(self, config: EngineConfig, model_config: ModelConfig) -> DecodeGraphs | None:
        """Decode steps over static buffers, captured as CUDA graphs where the platform does (counted in the
        start-up time). Not for mixture-of-experts models, whose routing sizes its work from the router's values."""
        if not config.decode_graphs:
            return None
        if model_config.moe is not None:
            logger.info("decode graphs off: a mixture-of-experts model's routing reads device values on the host")
            return None
        if not (self._runner.kernel_attention or self._runner.paged_kernel):
            # Gathering would copy every sequence's pages up to max_model_len each step: graphs need a paged kernel.
            logger.warning("decode graphs off: no kernel attends over pages in place here (Triton on a GPU, "
                           "Kiln's C++ kernels on a CPU)")
            return None
        return self._runner.use_decode_graphs(config.max_num_seqs, self.max_model_len, self._cache.reserve_page(),
                                              capture=config.platform.captures_graphs)

    # ---- what the engine holds ----------------------------------------------------------------------

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """Decode steps' static buffers and, on a GPU, their captured graphs; None where every step is dynamic."""
        return self._decode_graphs

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

    def use_prefix_store(self, store: PageStore) -> StoredPrefixes:
        """Write every page the prefix index names behind to `store`, and fetch from it what a prompt's
        prefix lacks in the pool (kiln/engine/stored_prefixes.py). Once, before the first request."""
        with self._lock:
            if self._stored is not None:
                raise RuntimeError("the engine has a prefix store already")
            self._stored = StoredPrefixes(self._cache, store, self.stats, self._notify)
            self._scheduler.stored = self._stored
            return self._stored

    @property
    def stored_prefixes(self) -> StoredPrefixes | None:
        """The engine's side of the persistent prefix store (None: off): its measured `costs`."""
        return self._stored

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def kv_usage(self) -> PoolUsage:
        with self._lock:
            self._last_usage = self._cache.usage()
            return self._last_usage

    def kv_usage_nowait(self) -> PoolUsage:
        """The pool's usage without waiting for the engine lock: exact when the lock is free, else the
        last exact reading (health probes use it: they must answer while a step or a slow session
        operation holds the lock)."""
        if self._lock.acquire(blocking=False):
            try:
                self._last_usage = self._cache.usage()
            finally:
                self._lock.release()
        return self._last_usage

    def in_flight(self) -> list[InFlight]:
        """Every request the engine holds now, oldest first: queued, running, or paused (its client
        stopped reading). One lock hold copying a few numbers per request (the dashboard polls it)."""
        now = time.perf_counter()
        with self._lock:
            scheduler = self._scheduler
            held = [request.in_flight(state, now) for state, requests in
                    (("queued", scheduler.waiting), ("running", scheduler.running), ("paused", scheduler.paused))
                    for request in requests]
        return sorted(held, key=lambda request: -request.age_s)

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
        """Requests queued or running (none once the loop died: each has had its error event)."""
        if self._failure is not None:
            return 0
        with self._lock:
            return len(self._scheduler.requests())

    @property
    def alive(self) -> bool:
        """False once the loop died: nothing would ever run a new request. Lock-free (health reads it)."""
        return self._failure is None and (self._thread is None or self._thread.is_alive() or self._stopping)

    @property
    def failure(self) -> BaseException | None:
        """What killed the loop; None while it can run."""
        return self._failure

    def add_failure_observer(self, observe: FailureObserver) -> None:
        """`observe(error)` once if the loop dies, on its thread, after every open request had its error
        event; at once if it already died. It must not block."""
        with self._wake:
            failure = self._failure
            if failure is None:
                self._failure_observers.append(observe)
        if failure is not None:
            observe(failure)

    def _refuse_if_dead(self) -> None:
        if self._failure is not None:
            raise self._unavailable()

    def _unavailable(self) -> UnavailableError:
        error = UnavailableError(f"the engine loop stopped after an internal error ({type(self._failure).__name__}: "
                                 f"{self._failure}); see the server log")
        error.__cause__ = self._failure
        return error

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
            self._refuse_if_dead()
            table, computed = self._cache.fork(parent.table, parent.num_computed, parent.tokens[:at])
            child = Sequence(parent.tokens[:at], table, session=True, num_computed=computed)
            child.forgotten_tokens = self._forgotten(child, len(child.tokens))  # the parent counted them
            self._scheduler.park(child)
            return child

    def append(self, seq: Sequence, token_ids: list[int]) -> None:
        """Extend an idle session sequence's history (validated ids); the next generate prefills them."""
        with self._lock:
            self._refuse_if_dead()
            seq.tokens.extend(token_ids)
            self._scheduler.park(seq)

    def check_sequence(self, seq: Sequence) -> None:
        """INV-1 on an idle sequence: its pages agree with its tokens (raises InvariantViolation). Once
        the loop died there is nothing to check: no step will read these pages again (and the finish
        events that end its requests run this)."""
        with self._lock:
            if self._failure is None:
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
            return SequenceKV(seq.num_computed, pages, pages * page_bytes, seq.table.policy, tier_bytes,
                              global_pages * page_bytes, seq.forgotten_tokens)

    def capture_sequence(self, seq: Sequence, known: dict[PageKey, int]) -> KVImage:
        """A copy of an idle session sequence's K/V, taken between steps (see KVCache.capture for
        `known`). FailedPreconditionError while a request runs on it: its pages are being written.
        Once the loop died no page can be trusted, but the history can: the image holds it alone (the
        K/V is recomputed after a restore), so a session's last turns still reach its snapshot."""
        with self._lock:
            if self._failure is not None:
                return KVImage(list(seq.tokens), 0, seq.table.policy, [[] for _ in self._cache.layout.groups], {})
            if any(r.seq is seq for r in self._scheduler.requests()):
                raise FailedPreconditionError("a generation is running on this sequence")
            return self._cache.capture(seq.table, seq.tokens, seq.num_computed, known)

    def load_sequence(self, image: KVImage) -> Sequence:
        """A session sequence over an image's tokens holding its K/V (checked by the caller against this
        engine's format). If the pool cannot hold the pages now, the history alone: the next turn
        recomputes the K/V, as after memory pressure."""
        with self._lock:
            self._refuse_if_dead()
            table = self._cache.load(image)
            computed = image.num_computed if table is not None else 0
            if table is None:
                table = PageTable.empty(self._cache.layout.num_groups, image.policy)
            seq = Sequence(list(image.tokens), table, session=True, num_computed=computed)
            seq.forgotten_tokens = self._forgotten(seq, len(seq.tokens))  # counted when they were forgotten
            self._scheduler.park(seq)
            self._write_behind()
            return seq

    def release_sequence(self, seq: Sequence) -> None:
        """The sequence's owner is done with it: pages go back now, or when its running request ends
        (never, once the loop died: the pool is not touched again)."""
        with self._lock:
            seq.closed = True
            if self._failure is not None or any(r.seq is seq for r in self._scheduler.requests()):
                return
            self._scheduler.unpark(seq)
            self._cache.release(seq.table)
            seq.num_computed = 0

    # ---- requests -----------------------------------------------------------------------------------

    def submit(self, seq: Sequence, params: SamplingParams, emit: Callable[[Event], None],
               caller: str | None = None) -> Request:
        """Queue a generation over `seq` (whose tokens are its prompt/history) for `caller` (whose share
        of the batch slots it takes: Request.caller). Raises before queueing if it can never run: empty,
        longer than the context, or larger than the whole KV pool."""
        self.check_request(len(seq.tokens), params, seq.table.policy)
        stop_ids = set(self.validate_tokens(params.stop_token_ids, "stop_token_ids"))
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        stop_ids = frozenset(stop_ids)
        matcher = None if params.constraint is None else self._constraints.matcher(params.constraint, stop_ids)
        request = Request(seq, params, emit, stop_ids, matcher, caller=caller)
        with self._wake:
            if self._stopping:
                raise UnavailableError("the engine is shutting down")
            self._refuse_if_dead()
            if not self.alive:
                raise UnavailableError("the engine loop stopped after an internal error; see the server log")
            self._scheduler.add(request)
            self._outputs.track(request)
            self._ensure_thread()
            self._wake.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a generation; its finish event ("cancelled") follows from the engine thread."""
        request.cancelled.set()
        with self._wake:
            self._wake.notify()

    def resume(self, request: Request) -> None:
        """Run a generation its consumer paused (`Request.paused`) again, from its next step."""
        request.paused.clear()
        with self._wake:
            self._wake.notify()

    def add_finish_observer(self, observe: Callable[[Request, str], None]) -> None:
        """Called on the engine thread, without the engine lock, with each request and its finish
        reason (metrics use it). One that raises is logged; the finish event still goes out."""
        self._outputs.add_observer(observe)

    # ---- the loop -----------------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None:
            sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
            self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        """Steps while there is work, until shutdown. Whatever escapes the step's own error handling
        kills the loop, and `_die` then ends every open request: no caller is left waiting."""
        try:
            while self._wait_for_work():
                self._guarded_step()
        except BaseException as error:  # noqa: BLE001 - the loop's death is reported, never lost
            self._die(error)

    def _wait_for_work(self) -> bool:
        """False once shutdown began."""
        with self._wake:
            while not self._stopping and not (self._scheduler.has_work() or self._finished or self._ahead):
                self._wake.wait(self._stored.timeout_s() if self._stored is not None else None)
            return not self._stopping

    def _guarded_step(self) -> None:
        try:
            self.step()
        except Exception as error:  # a bug in a step fails the requests in flight, never the engine
            logger.exception("engine step failed; failing the requests in flight")
            self._ahead = None
            with self._lock:
                ended = self._fail(self._scheduler.requests(), error)
            self._outputs.deliver(ended)

    def _die(self, error: BaseException) -> None:
        """The loop cannot go on (failing a failed step's requests failed too, so the pages and the
        scheduler cannot be trusted). Refuse everything from now on, tell the failure observers (health and
        `kiln serve` know before any caller hears of it), then end every open request with an
        UnavailableError without touching the pool. Never raises."""
        logger.critical("the engine loop died; failing every open request", exc_info=error)
        with self._wake:
            self._failure = error
            observers = list(self._failure_observers)
            self._wake.notify_all()
        for observe in observers:
            try:
                observe(error)
            except Exception:
                logger.exception("an engine failure observer raised")
        failed = self._outputs.fail_open(self._unavailable())
        logger.critical("%d open requests ended with UNAVAILABLE", failed)

    def shutdown(self) -> None:
        """Stop the loop (after the step in flight, whose forward still writes pages), then cancel
        everything queued or running and release stateless requests' pages. Whatever happens on the
        way, no request is left without a finish event."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._stored is not None:
            self._stored.close()
        try:
            if self._failure is None:
                with self._lock:
                    if self._ahead is not None:  # its rows' K/V, past the histories, was never committed
                        for chunk in self._ahead.chunks:
                            seq = chunk.request.seq
                            seq.num_computed = self._cache.drop(seq.table, seq.num_computed)
                        self._ahead = None
                    ended = [self._finish(r, "cancelled") for r in self._scheduler.requests()]
                    self._release_finished()
                self._outputs.deliver(ended)
        finally:
            self._outputs.fail_open(UnavailableError("the engine shut down"))
            _live_engines.discard(self)

    def step(self) -> None:
        """One scheduler step: schedule -> forward -> commit -> sample -> accept -> emit; or, where a decode step
        was launched ahead (kiln/engine/run_ahead.py), that step's commit -> accept -> emit. Safe to call
        directly when no loop thread runs (tests)."""
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
            with self._lock:
                keep = [i for i, c in enumerate(launched.chunks) if c.request in self._scheduler.running]
                launched = launched.only(keep)
                self._commit(launched.chunks)
            if launched.chunks:
                self._complete(launched)
            return
        with self._lock:
            chunks, inputs, ended = self._schedule()
        self._outputs.deliver(ended)
        if inputs is None:
            return
        sampling = [c for c in chunks if c.samples]  # read before the commit moves num_computed
        logits = self._forward(chunks, inputs)
        if logits is None:
            return
        if self.config.async_scheduling and inputs.decode is not None and len(sampling) == len(chunks) and all(
            runs_ahead(c.request, self.max_model_len, self._on_host) for c in sampling
        ):
            self._complete(LaunchedDecode(sampling, self._step_sampler.launch([c.request for c in sampling], logits)))
            return
        self._accept(sampling, self._step_sampler.sample(sampling, logits))

    def _accept(self, sampling: list[ScheduledChunk], sampled: list[list[Sampled] | Exception]) -> None:
        """The step's tokens join their requests (and stream out); requests they end finish. A request that a
        decode step launched ahead (`_ahead`) computes a row for loses that row's K/V past its history."""
        accepted = self._outputs.accept([c.request for c in sampling], sampled)
        with self._lock:
            self._settle_drafts(sampling, sampled, accepted.appended)
            self._write_behind()
            ended = [self._finish(r, reason, stop_string) for r, reason, stop_string in accepted.endings]
            ended += [finished for r, error in accepted.failures for finished in self._fail([r], error)]
            if self._ahead is not None:
                for request, _ in ended:
                    request.seq.num_computed = self._cache.drop(request.seq.table, request.seq.num_computed)
        self._outputs.deliver(ended)

    def _complete(self, launched: LaunchedDecode) -> None:
        """A plain decode step whose ids are still on the device: their copy to the host starts, the next decode
        step is launched from them where it may be (`_run_ahead`), and only then are they waited for and
        accepted, so that their processing overlaps the next step on a GPU."""
        launched.copy_out()
        self._ahead = self._run_ahead(launched)
        self._accept(launched.chunks, launched.sampled())

    def _run_ahead(self, launched: LaunchedDecode) -> LaunchedDecode | None:
        """The next decode step of the same requests, launched with `launched`'s ids as its input tokens before
        they reach the host; None where it may not run ahead (kiln/engine/run_ahead.py) or its pages or bucket
        are not there. Its K/V is committed once the tokens have joined (`step`)."""
        chunks = [ScheduledChunk(c.request, 1) for c in launched.chunks]
        with self._lock:
            scheduler = self._scheduler
            if scheduler.waiting or scheduler.paused or self._stopping or len(chunks) != len(scheduler.running):
                return None
            if not all(runs_ahead(c.request, self.max_model_len, self._on_host) for c in chunks):
                return None
            ensured = [c.request.seq for c in chunks if self._cache.ensure(c.request.seq.table, c.request.seq.num_computed + 1)]
            inputs = None
            if len(ensured) == len(chunks):
                inputs = self._runner.prepare_ahead([Chunk(c.request.seq, 1) for c in chunks], launched.ids)
            if inputs is None:
                for seq in ensured:
                    seq.num_computed = self._cache.drop(seq.table, seq.num_computed)
                return None
        try:
            logits = self._runner.run(inputs)
        except Exception:  # nothing is lost: the requests go on through the scheduler, which fails them if it recurs
            logger.exception("a decode step launched ahead failed; scheduling the next step instead")
            with self._lock:
                for c in chunks:
                    c.request.seq.num_computed = self._cache.drop(c.request.seq.table, c.request.seq.num_computed)
            return None
        self.stats.static_decode_steps += 1
        self.stats.ahead_steps += 1
        return LaunchedDecode(chunks, self._step_sampler.launch([c.request for c in chunks], logits))  # type: ignore[arg-type]

    def _schedule(self) -> tuple[list[ScheduledChunk], StepInputs | None, list[Finished]]:
        """Under the lock: this step's chunks and their model inputs (None: nothing to run), and the
        requests that ended before it (cancelled, or refused by the scheduler)."""
        self._release_finished()
        ended = self._drop_cancelled()
        chunks = self._scheduler.schedule()
        ended += [self._finish(r, "error", error=e) for r, e in self._scheduler.failed]
        self._scheduler.failed.clear()
        if not chunks:
            return chunks, None, ended
        inputs = self._runner.prepare([Chunk(c.request.seq, c.num_tokens, int(c.samples) + len(c.draft), c.draft) for c in chunks])
        return chunks, inputs, ended

    def _forward(self, chunks: list[ScheduledChunk], inputs: StepInputs) -> torch.Tensor | None:
        """Runs the model (without the lock) and commits the K/V it wrote. The logits of the sampling
        rows, or None: no row samples, or the forward failed (its requests then failed)."""
        try:
            started = time.perf_counter()
            logits = self._runner.run(inputs)
        except Exception as error:  # a failed forward fails its requests, never the engine
            with self._lock:
                ended = self._fail([c.request for c in chunks], error)
            self._outputs.deliver(ended)
            return None
        self.stats.note_step_attention(inputs.attention.kv.peak_bytes)
        self.stats.static_decode_steps += inputs.decode is not None
        with self._lock:
            self._commit(chunks)
            if self._stored is not None:
                self._stored.costs.observe_step(time.perf_counter() - started, int(inputs.input_ids.numel()))
                self._write_behind()
        return logits

    def _commit(self, chunks: list[ScheduledChunk]) -> None:
        self.stats.steps += 1
        for chunk in chunks:
            seq = chunk.request.seq
            self.stats.prefill_tokens += max(0, min(chunk.num_tokens, chunk.request.prompt_tokens - seq.num_computed))
            seq.num_computed += chunk.num_tokens - len(chunk.draft)  # a draft's rows count once accepted
            self._cache.commit(seq.table, seq.tokens, seq.num_computed)
            forgotten = self._forgotten(seq, seq.num_computed)
            if forgotten > seq.forgotten_tokens:  # a sink_window history passed sink + window (ADR 0008 OQ-2)
                self.stats.kv_forgotten_tokens += forgotten - seq.forgotten_tokens
                seq.forgotten_tokens = forgotten

    def _write_behind(self) -> None:
        """Under the lock hold that named them: offer newly named pages to the prefix store."""
        if self._stored is not None:
            self._stored.write_behind()

    def _forgotten(self, seq: Sequence, num_tokens: int) -> int:
        return seq.table.policy.forgotten(num_tokens, self._cache.page_size)

    def _settle_drafts(self, chunks: list[ScheduledChunk], sampled: list[list[Sampled] | Exception], appended: list[int]) -> None:
        """Under the lock, once the tokens joined: speculative chunks keep the K/V of the draft tokens
        that joined (verification accepted all but the last token it returned)."""
        for chunk, count, result in zip(chunks, appended, sampled, strict=True):
            if chunk.draft:
                self._settle_draft(chunk, count, 0 if isinstance(result, Exception) else len(result) - 1)

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
        checks the draft at verification (step_sampler.mask_draft_rows)."""
        if self._proposer is None:
            return []
        room = min(limit, request.params.max_tokens - len(request.generated) - 1, self.max_model_len - len(request.seq.tokens) - 1)
        return self._proposer.propose(request, room)

    # ---- endings (under the lock; their events are delivered after it is released) ------------------

    def _finish(self, request: Request, reason: str, stop_string: str | None = None, error: Exception | None = None) -> Finished:
        self._scheduler.remove(request)
        if self._stored is not None:
            self._stored.forget(request)
        usage = request.settle_usage()
        self.stats.reused_tokens += request.reused_tokens
        self.stats.prefix_hit_tokens += request.prefix_hit_tokens
        self.stats.requests_by_outcome[reason] += 1
        self._sampler.forget(request.request_id)
        seq = request.seq
        if not seq.session or seq.closed:
            self._finished.append(request)
        else:
            self._scheduler.park(seq)
        return request, FinishEvent(reason, usage, stop_string, error)

    def _fail(self, requests: list[Request], error: Exception) -> list[Finished]:
        """End requests with an error, dropping pages allocated past what they computed."""
        for request in requests:
            request.seq.num_computed = self._cache.drop(request.seq.table, request.seq.num_computed)
        return [self._finish(request, "error", error=error) for request in requests]

    def _drop_cancelled(self) -> list[Finished]:
        cancelled = [r for r in self._scheduler.requests() if r.cancelled.is_set()]
        self.stats.stall_cancels += sum(r.stalled for r in cancelled)
        return [self._finish(r, "cancelled") for r in cancelled]

    def _release_finished(self) -> None:
        for request in self._finished:
            self._cache.release(request.seq.table)
            request.seq.num_computed = 0
        self._finished.clear()


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _shutdown_live_engines() -> None:
    """A loop thread still inside a forward when the interpreter tears down aborts the process
    ("terminate called without an active exception"): stop every engine first."""
    for engine in list(_live_engines):
        engine.shutdown()
