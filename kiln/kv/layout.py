"""KVLayout: how a model's attention layers map onto KV pages.

Layers that see the same span of keys (full attention, or one sliding window) share a page table, so a
page can be released for some layers while others still read it. Every page in the pool has the same
shape: it holds `slots` layers of K/V for `page_size` positions. A model with 15 sliding-window layers
and 3 global ones gets slots=3, one global group and five sliding groups: the sliding groups' pages
outside the window go back to the pool while the global group keeps the whole history (vLLM's hybrid
allocator does the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce
from math import gcd
from typing import Protocol


class ModelShape(Protocol):
    """All the KV cache knows of a model (kiln.models.config.ModelConfig has it). Stated here, not imported:
    the models sit above the KV cache (docs/architecture.md § Layers)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    def window_of(self, layer: int) -> int | None:
        """Number of most recent keys (the query's own included) a layer may attend to; None = all."""
        ...


@dataclass(frozen=True)
class KVGroup:
    """Layers (one per slot) that share page tables; `window` is their sliding window, None = all keys."""

    layers: tuple[int, ...]
    window: int | None


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    slots: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def for_model(cls, config: ModelShape, page_size: int) -> KVLayout:
        by_window: dict[int | None, list[int]] = {}
        for layer in range(config.num_layers):
            by_window.setdefault(config.window_of(layer), []).append(layer)
        slots = reduce(gcd, (len(layers) for layers in by_window.values()))
        groups = tuple(
            KVGroup(tuple(layers[i : i + slots]), window)
            for window, layers in sorted(by_window.items(), key=lambda item: item[0] or 0)
            for i in range(0, len(layers), slots)
        )
        return cls(groups, slots, page_size, config.num_kv_heads, config.head_dim)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group index, slot index) of each model layer, indexed by layer."""
        found = {layer: (g, s) for g, group in enumerate(self.groups) for s, layer in enumerate(group.layers)}
        return [found[layer] for layer in range(len(found))]

    @property
    def num_groups(self) -> int:
        return len(self.groups)
