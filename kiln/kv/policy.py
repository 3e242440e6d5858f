"""KVPolicy: which pages of a sequence attention reads, and which of them stay resident in the pool.

A policy is chosen per sequence (EngineConfig.kv_policy, overridable per session) and fixed for the
sequence's life: its K/V depend on it, so a policy's `key` is part of the page-chain salt, and a session
that wants another policy is a new session (a fork inherits its parent's policy).

Sliding-window groups read only their window whatever the policy. Global groups (window None) obey it:
- `full`: every earlier key is read and stays resident (exact, memory grows with history).
- `sink_window`: only the sink and the recent window are read and resident; everything between is
  dropped (StreamingLLM: bounded, approximate; positions keep their original RoPE angles).
- `restore`: the same resident set as `sink_window`, but attention still reads every key: pages that
  leave the resident set live in a lower tier (kiln/kv/tiers.py) and are streamed back chunk by chunk
  (kiln/models/streamed_attention.py), so the result equals `full` up to float rounding.

Granularity is the page. The sink is the first ceil(sink_tokens / page_size) pages. The window is every
page holding one of the last `window_tokens` positions before the next query: at most
ceil(window_tokens / page_size) + 1 pages, and a query sees at least `window_tokens` recent keys (up to
a page more). While a step runs, the pages of its new tokens and one page of rollback slack are resident
too, so a global group holds at most sink + window + 1 pages between steps, plus the pages of the
step's own chunk while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import InvalidArgumentError

POLICIES = ("full", "sink_window", "restore")


@dataclass(frozen=True)
class KVPolicy:
    name: str = "full"
    sink_tokens: int = 0  # sink_window / restore only
    window_tokens: int = 0  # sink_window / restore only

    @classmethod
    def create(cls, name: object, sink_tokens: object, window_tokens: object, page_size: int, max_tokens: int) -> KVPolicy:
        """A validated policy; InvalidArgumentError names the option at fault. `full` ignores the sizes."""
        if name not in POLICIES:
            raise InvalidArgumentError(f"kv_policy must be one of {list(POLICIES)}, got {name!r}", "kv_policy")
        if name == "full":
            return FULL
        for option, value in (("kv_sink_tokens", sink_tokens), ("kv_window_tokens", window_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgumentError(f"{option} must be a non-negative integer, got {value!r}", option)
        if window_tokens < page_size:  # type: ignore[operator]
            raise InvalidArgumentError(
                f"kv_window_tokens must be at least one page ({page_size} tokens), got {window_tokens}", "kv_window_tokens"
            )
        if sink_tokens + window_tokens > max_tokens:  # type: ignore[operator]
            raise InvalidArgumentError(
                f"kv_sink_tokens + kv_window_tokens ({sink_tokens} + {window_tokens}) exceed the model's context of "
                f"{max_tokens} tokens",
                "kv_window_tokens",
            )
        return cls(str(name), int(sink_tokens), int(window_tokens))  # type: ignore[call-overload]

    @property
    def key(self) -> bytes:
        if self.name == "full":
            return b"full"
        return f"{self.name}:{self.sink_tokens}:{self.window_tokens}".encode()

    @property
    def tiered(self) -> bool:
        """Pages leaving the resident set move to a tier (and attention streams them back)."""
        return self.name == "restore"

    def readable(self, window: int | None, num_pages: int, next_position: int, page_size: int) -> list[range]:
        """Page indices (below `num_pages`) a query at `next_position` or later may read, in order."""
        if window is None and self.name != "sink_window":
            return [range(0, num_pages)]
        return self.resident(window, num_pages, next_position, page_size)

    def resident(self, window: int | None, num_pages: int, next_position: int, page_size: int) -> list[range]:
        """Page indices (below `num_pages`) that must stay in the pool for a query at `next_position` or
        later; the others go back to the pool (and, for `restore`, to a tier first)."""
        if window is not None:
            return [range(min(num_pages, max(0, next_position - window + 1) // page_size), num_pages)]
        if self.name == "full":
            return [range(0, num_pages)]
        recent = min(num_pages, max(0, next_position - self.window_tokens + 1) // page_size)
        sink = min(recent, -(-self.sink_tokens // page_size))
        return [span for span in (range(0, sink), range(recent, num_pages)) if span]

    def forgotten(self, num_tokens: int, page_size: int) -> int:
        """Positions before `num_tokens` that a global group's query at `num_tokens` no longer reads:
        under `sink_window` the whole pages between the sink and the window (the session has started
        forgetting; its history keeps them), else 0 (`restore` streams them back). Never shrinks as
        `num_tokens` grows."""
        if self.name != "sink_window":
            return 0
        num_pages = -(-num_tokens // page_size)
        read = sum(len(span) for span in self.readable(None, num_pages, num_tokens, page_size))
        return (num_pages - read) * page_size

    def resident_limit(self, page_size: int) -> int | None:
        """Most pages a global group keeps between steps (see the module docstring); None = unbounded."""
        if self.name == "full":
            return None
        return -(-self.sink_tokens // page_size) + -(-self.window_tokens // page_size) + 2


FULL = KVPolicy()
