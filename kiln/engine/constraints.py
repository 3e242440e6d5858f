"""Grammar-constrained decoding: a generation's text must match a JSON schema, any JSON object, a regex or
a Lark grammar, enforced by masking the logits of every token the grammar cannot take next, so the
output always parses, even on a small base model.

The work is llguidance's (chosen over xgrammar by measurement on the embedded model's 262,144-token
vocabulary, see bench/README.md § structured.py: it compiles schemas fast, reports unsupported
schema keywords instead of ignoring them, and brings no dependencies, where xgrammar needs
triton and transformers). Three pieces:

- `Constraint`: what the text must match, compared by content.
- `ConstraintCompiler` (one per model vocabulary, shared process-wide): turns a constraint into a
  compiled grammar once (LRU cache by content) on a compile thread of its own for the caller, never on
  the engine thread. Its tokenizer index costs seconds on a large vocabulary, so it is built on first
  use or by `warm()`.
- `Matcher`: one generation's position in its grammar (fill the allowed-token mask, accept a token,
  roll back, terminated?), and `constrain`, which applies a batch's masks and logit biases before
  sampling.

JSON is generated in one canonical layout, `{"a": 1, "b": [2, 3]}` (no free whitespace): a base model
given free whitespace may pad forever. EOS is allowed exactly when the grammar accepts the text so
far; when nothing but EOS could follow, the matcher is terminated and the engine ends the generation
("stop") without spending a step on the EOS.

Hostile sources: a constraint over the limits of kiln/engine/constraint_limits.py is refused when it is
made; compiles run on big-stack threads under a time bound (kiln/engine/compile_threads.py); a grammar
that cannot produce a complete text within llguidance's limits is refused at compile by a probe (the
first tokens along the lowest allowed ids: an unproductive `$ref` or rule chain, or a regex whose lexer
explodes, fails there). One whose failure lies past a choice the probe did not take fails when a
generation reaches it, as InvalidArgumentError for that request, never as an invariant violation; an
unproductive grammar with a choice at every step (`a: ("x" | "y") a`) generates until max_tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NoReturn

import llguidance
import numpy as np
import torch

from kiln.engine.compile_threads import CompileThreads
from kiln.engine.constraint_limits import LIMITS, check_schema, check_source, parse_schema
from kiln.engine.transfers import to_device
from kiln.errors import InvalidArgumentError, InvariantViolation
from kiln.platform import Platform
from kiln.tokenizer import Tokenizer

KINDS = ("json_schema", "json_object", "regex", "grammar")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SOURCE_CHARS = LIMITS.max_source_chars  # a schema or grammar larger than this is refused before compiling
PROBE_TOKENS = 4  # tokens a compile walks to find a grammar that fails within llguidance's limits
CACHE_ENTRIES = 256  # compiled grammars kept per vocabulary (least recently used dropped first)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
# Unbounded numbers' bounds (as_generated): the largest double below 2**63, as llguidance reads bounds as
# doubles and 2**63 - 1 itself rounds past the 64-bit range; 19 digits
INT64_BOUND = 2**63 - 1024
NUMBER_DECIMALS = 9  # decimals of a number without multipleOf
_BOUNDED_NUMBER = {"type": "number", "minimum": -INT64_BOUND, "maximum": INT64_BOUND, "multipleOf": 10.0 ** -NUMBER_DECIMALS}
# any JSON object (json_object), its numbers bounded as as_generated bounds a schema's
ANY_OBJECT = {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}, "$defs": {"value": {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, _BOUNDED_NUMBER, {"type": "string"},
    {"type": "array", "items": {"$ref": "#/$defs/value"}},
    {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}}}


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must match. `kind` is one of KINDS; `source` the JSON schema (JSON
    text), regex or Lark grammar (empty for json_object). `param` names the request field it came from,
    for error messages; it is not part of the identity, so equal constraints share one compiled grammar."""

    kind: str
    source: str
    param: str = field(default="", compare=False)

    @classmethod
    def json_schema(cls, schema: object, param: str = "json_schema") -> Constraint:
        """A JSON schema as a mapping or JSON text (a boolean schema does not compile)."""
        if isinstance(schema, str):
            schema = parse_schema(schema, param)
        if not isinstance(schema, Mapping | bool):
            raise InvalidArgumentError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
        return cls("json_schema", json.dumps(as_generated(schema, param), ensure_ascii=False), param)

    @classmethod
    def json_object(cls, param: str = "json_object") -> Constraint:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: object, param: str = "regex") -> Constraint:
        return cls("regex", _text(pattern, param), param)

    @classmethod
    def grammar(cls, lark: object, param: str = "grammar") -> Constraint:
        """A Lark grammar in llguidance's dialect (`start:` rule; `%json {...}` embeds a JSON schema)."""
        return cls("grammar", _text(lark, param), param)

    @classmethod
    def one_of(cls, json_schema: object = None, regex: object = None, grammar: object = None) -> Constraint | None:
        """The constraint of a request that may set one of these fields (None: unconstrained)."""
        given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
                 if value is not None}
        if len(given) > 1:
            raise InvalidArgumentError(f"set at most one of json_schema, regex and grammar; got {', '.join(given)}",
                                       list(given)[1])
        if not given:
            return None
        (name, value), = given.items()
        return getattr(cls, name)(value)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}", self.param)
        check_source(self.kind, self.source, self.param or self.kind)

    def grammar_text(self) -> str:
        """The constraint in llguidance's grammar format."""
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        schema = self.source if self.kind == "json_schema" else json.dumps(ANY_OBJECT)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        except ValueError as error:  # a schema that is not an object (true, false)
            self._refuse(str(error))

    def check(self, threads: CompileThreads | None = None) -> None:
        """Raises InvalidArgumentError naming `param` if the constraint does not compile (an invalid
        schema, an unsupported keyword, a bad regex or grammar, a compile over the time limit). Needs no
        tokenizer: cheap enough for a server to check each part of a request before anything runs. On a
        compile thread (`threads`, default the process's), like every compile."""
        error = (threads or compile_threads).run(lambda: llguidance.LLMatcher.validate_grammar(self.grammar_text()),
                                                 self.param or self.kind, self.param or None)
        if error:
            self._refuse(error)

    def _refuse(self, error: str) -> NoReturn:
        where = self.param or self.kind
        raise InvalidArgumentError(f"{where} does not compile: {error.strip()}", self.param or None)


def as_generated(schema: object, param: str = "json_schema") -> object:
    """The schema as Kiln generates it, so that what is generated still validates against the original
    and always ends:

    - every object that lists `properties` is closed to others (additionalProperties: false) unless it
      says otherwise, as OpenAI's strict mode and xgrammar's do: a model cannot pad an object with keys
      nobody asked for (a base model happily copies the schema into its arguments). An object combined
      with allOf/anyOf/oneOf, and the members of an allOf, stay open: each describes only part of it.
    - an integer or number without a bound on a side gets +-INT64_BOUND there (19 digits, what JSON
      parsers read as a 64-bit integer), and a number without `multipleOf` at most NUMBER_DECIMALS
      decimals: otherwise a model may write digits until max_tokens. Bounded numbers are written
      without an exponent. `json_object` (any object, ANY_OBJECT) bounds its numbers alike.

    A schema over the limits of kiln/engine/constraint_limits.py is refused first (InvalidArgumentError
    naming `param`): the rewrite recurses as deep as the schema."""
    check_schema(schema, param)
    return _closed(schema)


def _closed(schema: object, close: bool = True) -> object:
    if isinstance(schema, list):
        return [_closed(item, close) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    result = {key: _closed_member(key, value) for key, value in schema.items()}
    open_keys = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf")
    if close and "properties" in result and not any(key in result for key in open_keys):
        result["additionalProperties"] = False
    return _bounded(result)


def _bounded(schema: dict) -> dict:
    """A numeric schema with the bounds it lacks (see as_generated)."""
    kinds = schema.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if not kinds & {"integer", "number"}:
        return schema
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = _BOUNDED_NUMBER["minimum"]
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = _BOUNDED_NUMBER["maximum"]
    if "number" in kinds and "multipleOf" not in schema:
        schema["multipleOf"] = _BOUNDED_NUMBER["multipleOf"]
    return schema


def _closed_member(key: str, value: object) -> object:
    if key in ("properties", "$defs", "definitions", "dependentSchemas") and isinstance(value, Mapping):
        return {name: _closed(member) for name, member in value.items()}
    if key in ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "not", "if", "then", "else",
               "contains", "additionalItems"):
        return _closed(value)
    if key == "allOf":
        return _closed(value, close=False)
    return value


def _text(value: object, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{param} must be a non-empty string", param)
    return value


compile_threads = CompileThreads()  # the process's compile threads (every vocabulary's compiler shares them)


class ConstraintCompiler:
    """Compiles constraints for one vocabulary. Thread-safe: compiles run on compile threads for their
    callers (a server's worker threads), so the engine thread only ever advances matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, threads: CompileThreads | None = None) -> None:
        self.vocab_size = vocab_size
        self.threads = threads or compile_threads
        self.model_eos = tuple(tokenizer.eos_token_ids)
        self._tokenizer = tokenizer
        self._index: llguidance.LLTokenizer | None = None
        self._index_lock = threading.Lock()
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_lock = threading.Lock()

    def warm(self) -> None:
        """Build the tokenizer index now (seconds on a 262k vocabulary) rather than on the first
        constrained request."""
        self._tokens()

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """The compiled grammar of `constraint` in its initial state (cached by content; do not advance
        it: `matcher` copies it). Raises InvalidArgumentError if it does not compile."""
        with self._cache_lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                return self._cache[constraint]
        tokens = self._tokens()
        compiled = self.threads.run(lambda: self._compiled(constraint, tokens), constraint.param or constraint.kind,
                                    constraint.param or None)
        with self._cache_lock:
            self._cache[constraint] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compiled(self, constraint: Constraint, tokens: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        """Compile and probe (on a compile thread): refused if it does not compile, matches only the
        empty text, or fails within PROBE_TOKENS tokens along the lowest allowed ids."""
        compiled = llguidance.LLMatcher(tokens, constraint.grammar_text(), log_level=0)
        if compiled.is_error():
            constraint._refuse(compiled.get_error())
        probe = Matcher(compiled.deep_copy(), self.vocab_size, frozenset(), self.model_eos)
        if probe.is_terminated():
            constraint._refuse("it matches only the empty text")
        try:
            probe.walk(PROBE_TOKENS)
        except InvalidArgumentError:
            constraint._refuse(f"it cannot produce a complete text within the grammar engine's limits: {probe.failure()}")
        return compiled

    def matcher(self, constraint: Constraint, stop_ids: frozenset[int]) -> Matcher:
        """A fresh matcher for one generation; `stop_ids` are the tokens that end it (EOS unless
        ignore_eos, plus its stop_token_ids): they are allowed exactly when the grammar accepts."""
        compiled = self.compile(constraint)
        with self._cache_lock:  # copying reads the shared compiled grammar
            inner = compiled.deep_copy()
        return Matcher(inner, self.vocab_size, stop_ids, self.model_eos, constraint.param or constraint.kind)

    def _tokens(self) -> llguidance.LLTokenizer:
        with self._index_lock:
            if self._index is None:
                self._index = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.model_eos) or None)
            return self._index


_compilers: dict[str, ConstraintCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(fingerprint: str, tokenizer: Tokenizer, vocab_size: int) -> ConstraintCompiler:
    """The compiler of one model's vocabulary, shared by every engine of the process that serves it
    (its tokenizer index and compiled grammars are built once)."""
    key = f"{fingerprint}/{vocab_size}"
    with _compilers_lock:
        if key not in _compilers:
            _compilers[key] = ConstraintCompiler(tokenizer, vocab_size)
        return _compilers[key]


class Matcher:
    """One generation's position in its grammar. The engine asks for the allowed-token mask before
    each sample and accepts the sampled token; a speculative decoder accepts proposals one by one and
    rolls back the rejected ones. Not thread-safe: one thread drives it at a time (the engine's, once
    submitted)."""

    def __init__(self, inner: llguidance.LLMatcher, vocab_size: int, stop_ids: frozenset[int],
                 model_eos: Sequence[int], param: str = "constraint") -> None:
        self._inner = inner
        self._param = param  # the request field the constraint came from, for errors
        self._vocab_size = vocab_size
        self._stop_set = frozenset(t for t in stop_ids if 0 <= t < vocab_size)
        # the model's EOS ids that do not end this generation (ignore_eos): never allowed
        self._barred = frozenset(t for t in model_eos if t not in stop_ids and 0 <= t < vocab_size)
        self._stop_ids = np.array(sorted(self._stop_set), dtype=np.int64)
        self._model_eos = np.array(sorted(t for t in model_eos if 0 <= t < vocab_size), dtype=np.int64)
        self._steps: list[bool] = []  # per accepted token: True if the grammar consumed it, False if it ended the text
        self._text_mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)  # the grammar's text tokens now
        self._fresh = False  # _text_mask belongs to the current state

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask of the current state into `out` (int32 words, bit i of word
        w = token 32w + i; 1 = allowed). Never all zero on a matcher that is not terminated."""
        out[:] = self._text_tokens()
        if self._inner.is_accepting():
            _set_bits(out, self._stop_ids, True)

    def allowed(self) -> torch.Tensor:
        """The allowed tokens of the current state as a bool tensor [vocab_size]."""
        words = np.empty_like(self._text_mask)
        self.fill_mask(words)
        return torch.from_numpy(_unpack(words[None, :], self._vocab_size)[0])

    def _text_tokens(self) -> np.ndarray:
        """The tokens the grammar can take next as text (no EOS), computed once per state."""
        if not self._fresh:
            self._raise_if_failed()
            self._inner.unsafe_compute_mask_ptr(self._text_mask.ctypes.data, self._text_mask.nbytes)
            self._raise_if_failed()
            _set_bits(self._text_mask, self._model_eos, False)
            self._fresh = True
        return self._text_mask

    def accept(self, token: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it now. A stop id
        is allowed when the grammar accepts the text so far, and ends it."""
        if token in self._stop_set and self._inner.is_accepting():
            self._steps.append(False)
            return True
        if token in self._barred or self._inner.try_consume_tokens([token]) != 1:
            return False
        self._steps.append(True)
        self._fresh = False
        return True

    def rollback(self, count: int) -> None:
        """Undo the last `count` accepted tokens."""
        if not 0 <= count <= len(self._steps):
            raise ValueError(f"cannot roll back {count} of {len(self._steps)} accepted tokens")
        consumed = sum(self._steps[len(self._steps) - count :])
        del self._steps[len(self._steps) - count :]
        if consumed and not self._inner.rollback(consumed):
            self._raise_if_failed()
            raise RuntimeError(f"llguidance could not roll back {consumed} tokens: {self._inner.get_error()}")
        self._fresh = self._fresh and not consumed

    def refusal(self, token: int) -> Exception:
        """Why `accept(token)` failed for a sampled token: the grammar over llguidance's limits (an
        InvalidArgumentError for the request), else a token outside the mask (only a bug: an invariant)."""
        try:
            self._raise_if_failed()
        except InvalidArgumentError as error:
            return error
        return InvariantViolation("constraint", f"sampled token {token} outside the mask")

    def failure(self) -> str | None:
        """Why the matcher failed (the first line of llguidance's error, not its parser state dump), or
        None while it works. Every token it accepted was allowed, so a failure is the grammar hitting one
        of llguidance's limits (items per step, lexer states): the constraint is too complex."""
        if not self._inner.is_error():
            return None
        return (self._inner.get_error().strip().splitlines() or ["unknown error"])[0]

    def _raise_if_failed(self) -> None:
        if (reason := self.failure()) is not None:
            raise InvalidArgumentError(f"{self._param} exceeded the grammar engine's limits during generation: {reason}",
                                       self._param)

    def walk(self, steps: int) -> None:
        """Advance up to `steps` tokens, each the lowest text token allowed, until the grammar accepts:
        raises InvalidArgumentError if it fails on the way (a compile-time probe; use a copy)."""
        for _ in range(steps):
            if self._inner.is_accepting():
                return
            allowed = np.flatnonzero(_unpack(self._text_tokens()[None, :], self._vocab_size)[0])
            if not len(allowed) or not self.accept(int(allowed[0])):
                self._raise_if_failed()
                return

    def eos_allowed(self) -> bool:
        """Whether the grammar accepts the text so far (the generation may end here)."""
        return self._inner.is_accepting()

    def is_terminated(self) -> bool:
        """The text is complete: a stop id ended it, or nothing but EOS could follow."""
        if self._steps and not self._steps[-1]:
            return True
        try:
            return not self._text_tokens().any()
        except InvalidArgumentError:  # over llguidance's limits: the next mask fails this request alone
            return False

    @property
    def accepted(self) -> int:
        """Tokens accepted so far (what `rollback` can undo)."""
        return len(self._steps)


def constrain(logits: torch.Tensor, matchers: Sequence[Matcher | None],
              biases: Sequence[tuple[tuple[int, float], ...]]) -> torch.Tensor:
    """What limits each row's choice before sampling: its grammar's mask (disallowed tokens to -inf)
    and its logit bias (added, OpenAI's `logit_bias`). Returns new logits when any row has either, else
    `logits` itself (never modified in place: a failed batch is sampled again row by row). One pass over
    the batch's logits: rows without a grammar get an all-allowed mask. Masks and biases are made on the
    host from the matchers' state, which this step's logits do not change, so on a device that work
    overlaps the forward still running there, and applying them reads nothing back."""
    masked = [row for row, matcher in enumerate(matchers) if matcher is not None]
    biased = [row for row, bias in enumerate(biases) if bias]
    if not masked and not biased:
        return logits
    if masked:
        words = np.full((logits.shape[0], (logits.shape[1] + 31) // 32), -1, dtype=np.int32)
        for row in masked:
            matchers[row].fill_mask(words[row])  # type: ignore[union-attr]
        logits = _blocked(logits, words)
    else:
        logits = logits.clone()
    if biased:
        entries = [(row, token, value) for row in biased for token, value in biases[row]]
        rows, tokens, values = zip(*entries, strict=True)
        index = to_device(torch.tensor([rows, tokens]), logits.device)
        logits[index[0], index[1]] += to_device(torch.tensor(values, dtype=logits.dtype), logits.device)
    return logits


def _blocked(logits: torch.Tensor, words: np.ndarray) -> torch.Tensor:
    """New logits with the tokens the bitmasks `words` ([rows, words], 1 = allowed) do not allow at -inf.
    On the CPU one NumPy pass in this thread: torch's elementwise ops split a 1 MB row across threads, and
    on a busy machine the step then waits for whichever of them was preempted. On a device the bitmasks
    (a 32nd of a bool mask's bytes) are copied there and unpacked there."""
    if not Platform.of(logits.device).on_host:
        packed = to_device(torch.from_numpy(words), logits.device)
        bits = packed[:, :, None] >> torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = (bits & 1).flatten(1)[:, : logits.shape[1]]
        return logits.masked_fill(allowed == 0, float("-inf"))
    blocked = _unpack(np.invert(words), logits.shape[1])
    if logits.dtype == torch.float32:
        return torch.from_numpy(np.where(blocked, np.float32(-np.inf), logits.numpy()))
    return logits.masked_fill(torch.from_numpy(blocked), float("-inf"))


def _unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """[rows, words] int32 bitmasks -> [rows, vocab_size] bool."""
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return bits.view(np.bool_)


def _set_bits(words: np.ndarray, tokens: np.ndarray, value: bool) -> None:
    if not len(tokens):
        return
    view = words.view(np.uint32)
    bits = np.left_shift(np.uint32(1), (tokens % 32).astype(np.uint32))
    if value:
        np.bitwise_or.at(view, tokens // 32, bits)
    else:
        np.bitwise_and.at(view, tokens // 32, ~bits)
