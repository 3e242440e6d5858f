"""A decode step's model code reads no device tensor back on the host (docs/architecture.md § Layers): on a GPU
such a read stalls the step until the device catches up, and a CUDA graph cannot hold one. Checked on the
CPU along the path a GPU takes (PyTorch ops, no C++ kernels, pages gathered by the codec), every dense
architecture, one and two sequences a step; the detector itself is checked to see each kind of read."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models.test_parity import PoisonedCache, make_pair, random_tokens
from tests.tiny_models import TINY_CONFIGS

aten = torch.ops.aten
# Ops whose result needs values on the host: a Python scalar, or an output whose size depends on the values.
VALUE_READS = {
    aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t)
    aten.item.default,  # the same under inference mode (the runner's), which does not decompose it
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
}
MIXTURES = {name for name, config in TINY_CONFIGS.items() if config.moe is not None}


class HostReads(TorchDispatchMode):
    """Records, while active, every operation that reads a tensor's values back on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in VALUE_READS:
            self.seen.append(str(func))
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in args[1]
        ):
            self.seen.append(f"{func} with a boolean mask")
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """The reads made inside the block: HostReads, and the Tensor methods that copy values out without an
    operation the dispatcher sees (tolist, numpy)."""
    with HostReads() as mode:
        originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

        def recording(name: str) -> Callable[..., Any]:
            def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                mode.seen.append(f"Tensor.{name}")
                return originals[name](tensor, *args, **kwargs)

            return read

        try:
            for name in originals:
                setattr(torch.Tensor, name, recording(name))
            yield mode.seen
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)


def decode_reads(arch: str) -> list[str]:
    """The host reads of the forward (model and LM head) in decode steps of one, then two sequences, on the
    PyTorch path (what a GPU runs), after untracked prefills."""
    pair = make_pair(TINY_CONFIGS[arch], fused=False)
    paged = PoisonedCache(pair.ours, pair.config, 4, 80)
    paged.cache.storage.kernel_pages = False  # the codec's PyTorch stores and gathered attention, as on a GPU
    paged.runner.kernel_attention = False
    first, second = paged.admit(random_tokens(30, seed=1)), paged.admit(random_tokens(21, seed=2))
    paged.step([(first, 22)])
    paged.step([(second, 13)])
    run, reads = paged.runner.run, []

    def tracked(inputs: Any) -> Any:
        with host_reads() as seen:
            logits = run(inputs)
        reads.extend(seen)
        return logits

    paged.runner.run = tracked  # type: ignore[method-assign]
    for _ in range(4):  # across a page boundary for both
        paged.step([(first, 1)])
        paged.step([(first, 1), (second, 1)])
    return reads


@pytest.mark.parametrize("arch", sorted(set(TINY_CONFIGS) - MIXTURES))
def test_a_decode_step_reads_nothing_back(arch: str) -> None:
    assert decode_reads(arch) == []


def test_the_detector_sees_every_kind_of_read() -> None:
    """The test above can fail: each read it looks for is seen, and a mixture of experts' routing (which reads
    expert counts on the host by design) is."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    reads = [
        lambda: int(x.max()), lambda: x.sum().item(), lambda: mask.nonzero(), lambda: x[mask], lambda: x.tolist(),
        lambda: x.numpy(), lambda: torch.unique(x.long()), lambda: torch.bincount(x.long()),
    ]
    for read in reads:
        for inference in (False, True):
            with torch.inference_mode(inference), host_reads() as seen:
                read()
            assert seen, "a read went unseen"
    with host_reads() as seen:
        x[:2] * 2 + x[torch.tensor([0, 2])]  # arithmetic and indexing by positions read nothing
    assert seen == []
    assert decode_reads(sorted(MIXTURES)[0])
