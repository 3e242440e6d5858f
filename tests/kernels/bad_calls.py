"""Kernel calls that break their index contracts, one per case, for test_contracts.py. `python -m
tests.kernels.bad_calls` makes every call and prints `<case>\t<outcome>` for each, the outcome being `ok` or
the exception's type name. Run in a subprocess: a kernel that trusted such indices would read or write out of
bounds, and a segfault would take pytest with it.

Each case is a valid call (VALID) with one thing broken; VALID itself must come back `ok`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.kernels import kernels

P, PAGE, KV_HEADS, D, HEADS = 4, 16, 2, 64, 4
HUGE = 10**9


def attention(table=((2, 0, 3),), first=((0, 16, 32),), row_seq=(0,), row_pos=(39,), rows=1, dtype=torch.long):
    """One sequence of 40 tokens on pages 2, 0, 3 of 4; its last position queries."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(P, PAGE, KV_HEADS, D, generator=g) for _ in range(2))
    q = torch.randn(rows, HEADS, D, generator=g)
    args = (torch.tensor(table, dtype=dtype), torch.tensor(first), torch.tensor(row_seq), torch.tensor(row_pos))
    kernels().paged_attention(q, k, v, *args, 0, D**-0.5)


def coded_attention(table=((2, 0, 3),)):
    codes = torch.zeros(P, PAGE, KV_HEADS, D, dtype=torch.int8)
    scales = torch.ones(P, PAGE, KV_HEADS, D // 32, dtype=torch.float16)
    none = torch.empty(0, dtype=torch.float16)
    q = torch.randn(1, HEADS, D)
    kernels().paged_attention_coded(q, codes, scales, none, codes, scales, none, torch.tensor(table),
                                    torch.tensor([[0, 16, 32]]), torch.tensor([0]), torch.tensor([39]), 0, D**-0.5)


def store(pages=(1,), offsets=(3,), scale_pages=P, dtype=torch.long):
    """One 8-bit coded row into page 1, slot 3."""
    codes = torch.zeros(P, PAGE, KV_HEADS, D, dtype=torch.int8)
    scales = torch.zeros(scale_pages, PAGE, KV_HEADS, D // 32, dtype=torch.float16)
    x = torch.randn(len(pages), KV_HEADS, D)
    kernels().store_kv(x, codes, scales, torch.empty(0, dtype=torch.float16), torch.tensor(pages, dtype=dtype),
                       torch.tensor(offsets, dtype=dtype))


VALID = "valid calls"
CASES: dict[str, Callable[[], None]] = {
    VALID: lambda: (attention(), coded_attention(), store()),
    "attention: a page id past the pool": lambda: attention(table=((2, 0, HUGE),)),
    "attention: a negative page id": lambda: attention(table=((2, -1, 3),)),
    "attention: page ids as floats": lambda: attention(dtype=torch.float32),
    "attention: a row of a sequence the table lacks": lambda: attention(row_seq=(5,)),
    "attention: more query rows than row_seq": lambda: attention(rows=3),
    "attention: first_pos narrower than the table": lambda: attention(first=((0, 16),)),
    "attention: first_pos not ascending": lambda: attention(first=((0, 32, 16),)),
    "attention: a position no page holds": lambda: attention(row_pos=(HUGE,)),
    "attention: a negative position": lambda: attention(row_pos=(-1,)),
    "coded attention: a page id past the pool": lambda: coded_attention(table=((2, 0, HUGE),)),
    "store: a page id past the pool": lambda: store(pages=(HUGE,)),
    "store: an offset past the page": lambda: store(offsets=(PAGE,)),
    "store: scales for fewer pages than the codes": lambda: store(pages=(P - 1,), scale_pages=1),
    "store: page ids as floats": lambda: store(dtype=torch.float32),
}


def main() -> None:
    for case, call in CASES.items():
        try:
            call()
            outcome = "ok"
        except Exception as error:  # the outcome is the exception's type, whatever it is
            outcome = type(error).__name__
        print(f"{case}\t{outcome}", flush=True)


if __name__ == "__main__":
    main()
