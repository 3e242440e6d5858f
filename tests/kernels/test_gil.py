"""The kernels release the GIL while they run (bindings.cpp): another Python thread (the server's event loop,
the snapshot saver) keeps running during a long kernel call instead of waiting for it to return."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kiln.kernels import kernels, supported
from tests.models.test_fused_block import one_sequence_step, random_layer, rope

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run here")

SLICES = 10  # of each call's middle 80 %, the other thread must show progress in at least MOVING
MOVING = 3  # (with the GIL held from the start of a call to its end, it shows none)


def long_linear(shortest_s: float = 0.15):
    """A linear_f32 call over packed weights, its rows doubled until one call takes `shortest_s`."""
    n = k = 2048
    weights = torch.randn(n // 8, k // 8, 8, 8)
    rows = 64
    while True:
        x = torch.randn(rows, k)
        started = time.perf_counter()
        kernels().linear_f32(x, weights, None, n)
        if time.perf_counter() - started >= shortest_s or rows >= 8192:
            return lambda: kernels().linear_f32(x, weights, None, n)
        rows *= 2


def long_layer(shortest_s: float = 0.15):
    """A decoder layer of a larger model (kernels/decoder_layer.h) over one sequence's appended rows, the rows
    doubled until one call takes `shortest_s`."""
    hidden, heads, kv_heads, head_dim = 1024, 8, 2, 128
    layer = random_layer(hidden, heads, kv_heads, head_dim, 4096)
    rows = 8
    while True:
        x, (cos, sin), (args, _) = torch.randn(rows, hidden), rope(rows, head_dim), one_sequence_step(rows, kv_heads, head_dim)
        started = time.perf_counter()
        layer.run(x, cos, sin, *args)
        if time.perf_counter() - started >= shortest_s or rows >= 1024:
            return lambda: layer.run(x, cos, sin, *args)
        rows *= 2


@pytest.mark.parametrize("make_call", [long_linear, long_layer], ids=["linear", "decoder_layer"])
def test_another_thread_runs_during_a_long_kernel_call(make_call) -> None:
    call = make_call()
    ticks: list[float] = []  # the other thread's progress, at most one mark a millisecond
    stop = threading.Event()

    def other_thread() -> None:
        last = 0.0
        while not stop.is_set():
            now = time.perf_counter()
            if now - last >= 0.001:
                ticks.append(now)
                last = now

    thread = threading.Thread(target=other_thread)
    thread.start()
    calls = []
    try:
        for _ in range(3):
            started = time.perf_counter()
            call()
            calls.append((started, time.perf_counter()))
    finally:
        stop.set()
        thread.join()
    for started, ended in calls:
        span = ended - started
        low = started + 0.1 * span
        width = 0.8 * span / SLICES
        busy = {int((t - low) // width) for t in ticks if low <= t < low + 0.8 * span}
        assert len(busy) >= MOVING, f"the other thread ran in {len(busy)} of {SLICES} slices of a {span * 1e3:.0f} ms call"
