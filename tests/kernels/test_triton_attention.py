"""The Triton paged-attention kernel (kiln/kernels/triton_attention.py) and the backend that calls it
(kiln/models/attention.py TritonAttention): over raw float32, float16 and bfloat16 pages and int8 / int4 coded
ones, sliding windows, query-head groups of 1 to 8, head dims 64 to 256, several sequences of several rows and
a sink+window page list, each row's pages in one split or several (some owning no page), and a long context,
it returns the attention a float64 reference computes over the same pages gathered by the KVStep; a tiny model
decodes alike through it and through GatheredAttention.

On the CPU the kernel runs in Triton's interpreter, a mode of the whole process fixed when Triton is imported
(TRITON_INTERPRET=1): test_under_the_interpreter runs this file's interpreter tests in a child process that
asks for it, and the rest of the suite (this process) keeps Triton as it was. What the interpreter cannot
check, compiling the kernels, is checked for an sm_90 target here (no GPU needed); the CUDA tests run the
compiled kernel, and capture it in a CUDA graph, where a GPU is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.kv.codec import KVCodec
from kiln.kv.layout import KVGroup, KVLayout
from kiln.kv.step import KVSlice, KVStep
from kiln.kv.storage import PageStorage
from kiln.models import attention
from kiln.models.attention import (
    IN_PLACE_MAX_ROWS,
    AttentionBatch,
    GatheredAttention,
    InPlaceAttention,
    TritonAttention,
)

triton = pytest.importorskip("triton")
from kiln.kernels import triton_attention  # noqa: E402  (after the skip: the module imports triton)

INTERPRETER = pytest.mark.skipif(
    not triton_attention.interpreting(), reason="runs under Triton's interpreter (test_under_the_interpreter)"
)
COMPILED = pytest.mark.skipif(triton_attention.interpreting(), reason="this process runs the interpreter")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]
SCALE = 0.125
# Per query dtype, relative to the reference's largest value: keys, values, weights and the output are
# rounded to it (bfloat16's 8 bits: a couple of units in the last place of the output).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@COMPILED
def test_under_the_interpreter() -> None:
    """This file's interpreter tests, in a child process with TRITON_INTERPRET=1 (the rest skip there)."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1", "KILN_TEST_DEVICE": "cpu"},
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@dataclass(frozen=True)
class Case:
    """One layer's pages: its codec and KV dtype (the query's too), heads, page size and window."""

    codec: str
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int = 4
    window: int | None = None


CASES = {
    "float32-gqa2": Case("none", torch.float32, 4, 2, 64),
    "float16-gqa4-page16": Case("none", torch.float16, 8, 2, 128, page_size=16),
    "bfloat16-mha-window": Case("none", torch.bfloat16, 4, 4, 64, window=7),
    "int8-gqa8": Case("int8", torch.float32, 8, 1, 64),
    "int8-float16-window": Case("int8", torch.float16, 4, 2, 64, window=10),
    "int4-gemma3-270m": Case("int4", torch.bfloat16, 4, 1, 256, window=9),  # 4 heads, 1 KV head, head_dim 256
}
# (first new position, rows, recent pages listed: 0 for all, else the first page and the last `recent`):
# speculative verification rows crossing a page, a first token, a decode row, and a decode row reading its
# first page and its last two only (a sink+window list).
Sequences = list[tuple[int, int, int]]
SEQUENCES: Sequences = [(13, 3, 0), (0, 1, 0), (9, 1, 0), (30, 1, 2)]
# A long context (4-token pages): a decode row over 200 pages of its 250, a sink page and its last 199.
LONG_SEQUENCES: Sequences = [(999, 1, 199)]


def page_indices(start: int, rows: int, recent: int, page_size: int) -> list[int]:
    last = (start + rows - 1) // page_size
    return sorted({0, *range(last + 1 - recent, last + 1)}) if recent else list(range(last + 1))


def make_step(case: Case, device: str, poison: bool = True, sequences: Sequences = SEQUENCES) -> KVStep:
    """A KVStep over `sequences` in one layer's pages, placed at random in a pool: listed pages hold random
    values; with `poison`, every slot no row may see (past a sequence's last position, unlisted pages) holds
    NaN where the format has floats (values, scales, zero points), so reading one shows."""
    gen = torch.Generator().manual_seed(0)
    layout = KVLayout((KVGroup((0,), case.window),), 1, case.page_size, case.kv_heads, case.head_dim)
    codec = KVCodec(case.codec, layout, case.dtype)
    listed = [page_indices(start, rows, recent, case.page_size) for start, rows, recent in sequences]
    pages = sum(map(len, listed)) + 3
    storage = PageStorage(layout, pages, codec, device)
    storage.data.fill_(0xFF if poison else 0)
    ids = iter(torch.randperm(pages, generator=gen).tolist())
    slices = []
    for (start, rows, _), indices in zip(sequences, listed, strict=True):
        own = [next(ids) for _ in indices]
        for page in own:
            values = torch.randn(2, 1, case.page_size, case.kv_heads, case.head_dim, generator=gen)
            storage.data[page] = codec.encode(values).to(device)
        for segment in storage.segments(0) if poison else ():
            for part in segment.parts():
                if part is not None and part.dtype.is_floating_point:
                    part[own[-1], (start + rows - 1) % case.page_size + 1 :] = float("nan")
        slices.append(KVSlice(start, rows, [own], [indices]))
    return KVStep(storage, slices)


def reference(q: torch.Tensor, kv: KVStep, scale: float) -> torch.Tensor:
    """float64 attention of each row over the keys its mask shows, keys and values rounded to q's dtype."""
    keys, values, mask = kv.read(0)
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for b, s in enumerate(kv.slices):
        for i in range(s.num_tokens):
            seen = mask[b, i].nonzero()[:, 0]
            k, v = (x[b][:, seen].to(q.dtype).double().repeat_interleave(group, 0).cpu()
                    for x in (keys, values))
            weights = torch.softmax((q[row].double().cpu()[:, None, :] * k).sum(-1) * scale, dim=-1)
            out[row] = (weights[..., None] * v).sum(1)
            row += 1
    return out


def kernel_call(attend: Callable[..., torch.Tensor], q: torch.Tensor, kv: KVStep, **options: Any) -> torch.Tensor:
    k, v, group, window = kv.pages(0)
    return attend(q, k, v, group.block_table, group.first_pos, group.page_counts, kv.row_seq, kv.row_pos,
                  window or 0, SCALE, **options)


def check(case: Case, attend: Callable[..., torch.Tensor], device: str, sequences: Sequences = SEQUENCES,
          **options: Any) -> None:
    kv = make_step(case, device, sequences=sequences)
    rows = sum(rows for _, rows, _ in sequences)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(rows, case.heads, case.head_dim, generator=gen).to(device, case.dtype)
    out = kernel_call(attend, q, kv, **options)
    assert out.dtype == q.dtype and out.shape == q.shape
    expected = reference(q, kv, SCALE)
    diff = (out.double().cpu() - expected).abs().max().item()
    assert diff <= TOLERANCE[case.dtype] * expected.abs().max().item(), f"{diff:.3g}"


@INTERPRETER
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("name", CASES)
def test_the_kernel_attends_like_the_reference(name: str, splits: int | None) -> None:
    """In one split (the automatic count for these few pages) and in three, merged: runs of one or two pages,
    the last split owning no row's pages, a 1-page row's second none either, and some holding only pages a
    row's window hides."""
    check(CASES[name], triton_attention.paged_attention, "cpu", splits=splits)


@INTERPRETER
@pytest.mark.parametrize("splits", [1, None, 7])
def test_a_long_context_attends_like_the_reference_in_any_splits(splits: int | None) -> None:
    """A sink list of 200 pages in one program, in the automatic 50 splits of 4 pages, and in 7 of 29 (the
    last shorter)."""
    case = Case("int4", torch.bfloat16, 4, 1, 64)  # Gemma 3 270M's heads
    assert triton_attention.split_count(1, case.kv_heads, 200) == 50
    check(case, triton_attention.paged_attention, "cpu", LONG_SEQUENCES, splits=splits)


def test_splits_fill_the_gpu_from_the_shapes_alone() -> None:
    """Gemma 3 270M (one KV head) at batch 1 over an 8k-token table of 16-token pages: 128 splits of 4 pages;
    over a 64k-token one, 256 of 16 (not past TARGET_PROGRAMS); a batch whose rows and KV heads fill the GPU
    alone, or a table too narrow to cut, keeps one."""
    count = triton_attention.split_count
    assert count(1, 1, 512) == 128
    assert count(1, 1, 4096) == 256
    assert count(64, 8, 4096) == count(1, 1, 4) == count(1, 1, 0) == 1


@INTERPRETER
def test_the_window_is_applied() -> None:
    """The cases' agreement is no accident of short histories: without its window the same step moves far
    beyond the tolerance."""
    case = Case("none", torch.float32, 4, 2, 64, window=5)
    kv = make_step(case, "cpu")
    q = torch.randn(6, 4, 64, generator=torch.Generator().manual_seed(2))
    windowed = kernel_call(triton_attention.paged_attention, q, kv)
    k, v, group, _ = kv.pages(0)
    unwindowed = triton_attention.paged_attention(
        q, k, v, group.block_table, group.first_pos, group.page_counts, kv.row_seq, kv.row_pos, 0, SCALE
    )
    assert (windowed - reference(q, kv, SCALE).float()).abs().max() <= 1e-5
    assert (windowed - unwindowed).abs().max() > 1e-2


@INTERPRETER
def test_the_backend_stores_the_rows_then_attends_like_gathered() -> None:
    """TritonAttention.attend writes the step's new K/V (int8 pages here), then reads them with the rest."""
    case = Case("int8", torch.float32, 4, 2, 64)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, heads, 64, generator=gen) for heads in (4, 2, 2))
    lengths = [rows for _, rows, _ in SEQUENCES]
    outputs = []
    for backend in (TritonAttention, lambda kv: GatheredAttention.for_lengths(lengths, kv)):
        kv = make_step(case, "cpu", poison=False)  # gathering multiplies what a mask hides by a zero weight
        outputs.append(backend(kv).attend(q, k, v, 0, SCALE))
    # Gathered pads the step's queries and masks; both sum in float32, in different orders.
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-5


def test_a_streamed_layer_takes_the_streamed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `restore` sequence's global layer is attended chunk by chunk by PyTorch (streamed_attention), not by
    the kernel, which reads only the pool."""
    calls = []
    monkeypatch.setattr(attention, "paged_attention", lambda *args: calls.append(args))
    kv = make_step(Case("none", torch.float32, 4, 2, 64), "cpu", poison=False)  # it reads pages whole
    for s in kv.slices:
        s.stream, s.tiered = True, [[]]
    kv = KVStep(kv.storage, kv.slices)
    assert kv.streams(0)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, heads, 64, generator=gen) for heads in (4, 2, 2))
    out = TritonAttention(kv).attend(q, k, v, 0, SCALE)
    assert not calls
    assert (out - reference(q, kv, SCALE).float()).abs().max() <= 1e-5


def test_the_backend_is_chosen_for_steps_of_few_rows() -> None:
    kv: Any = object()  # the choice reads only the lengths
    choose = AttentionBatch.for_lengths
    assert isinstance(choose([1, IN_PLACE_MAX_ROWS], kv, paged_kernel=True).backend, TritonAttention)
    assert isinstance(choose([IN_PLACE_MAX_ROWS + 1], kv, paged_kernel=True).backend, GatheredAttention)
    assert isinstance(choose([500], kv, batch_invariant=True, paged_kernel=True).backend, InPlaceAttention)
    assert isinstance(choose([1], kv).backend, GatheredAttention)


@INTERPRETER
def test_a_tiny_model_decodes_alike_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps (appends beside decode rows, across pages and windows; a full layer and two sliding
    ones over int4 pages) with every step's attention forced to TritonAttention, then gathered: the logits
    agree to float rounding."""
    from tests.models.test_parity import ATOL, PoisonedCache, make_pair, random_tokens, run
    from tests.tiny_models import TINY_CONFIGS

    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return triton_attention.paged_attention(*args)

    config = TINY_CONFIGS["qwen2"]
    pair = make_pair(config, fused=False)
    tokens = {0: random_tokens(20, seed=1), 1: random_tokens(13, seed=2)}
    steps = [{0: 9}, {0: 4, 1: 7}] + [{0: 1, 1: 1}] * 3 + [{0: 4, 1: 3}]
    outputs = []
    choose = AttentionBatch.for_lengths.__func__  # type: ignore[attr-defined]
    for kernel in (True, False):
        with monkeypatch.context() as patch:
            forced = classmethod(lambda cls, lengths, kv, *_, kernel=kernel: choose(cls, lengths, kv,
                                                                                 paged_kernel=kernel))
            patch.setattr(AttentionBatch, "for_lengths", forced)
            patch.setattr(attention, "paged_attention", counted)
            paged = PoisonedCache(pair.ours, pair.config, 4, 40, codec="int4")
            paged.runner.kernel_attention = False
            outputs.append(run(paged, tokens, steps))
    assert len(calls) == len(steps) * config.num_layers
    for seq in tokens:
        diff = (outputs[0][seq] - outputs[1][seq]).abs().max().item()
        assert diff <= ATOL, f"sequence {seq}: {diff:.3g}"


@INTERPRETER
def test_static_decode_steps_attend_through_the_kernel_like_the_dynamic_step() -> None:
    """Decode graphs' static buffers (kiln/engine/decode_graphs.py: rows padded to the bucket of 4 reading only
    the scratch page, block tables as wide as max_model_len, the page counts the kernel loops to) through the
    kernel give the dynamic step's logits over gathered pages."""
    from kiln.engine.runner import StepInputs
    from tests.engine.test_decode_graphs import decode_alike, setup
    from tests.models.test_parity import random_tokens

    paged, static = setup("gemma3", "gathered", 3 * 40)
    static.paged_kernel = True
    seqs = [paged.admit(random_tokens(length, seed=length)) for length in (23, 9, 30)]
    for seq, n in zip(seqs, (18, 5, 27), strict=True):
        paged.step([(seq, n)])

    def through_the_kernel(inputs: StepInputs) -> None:
        assert inputs.decode is not None and isinstance(inputs.attention.backend, TritonAttention)

    decode_alike(paged, static, seqs, 3, 1e-4, through_the_kernel)


@COMPILED
@pytest.mark.parametrize("name", CASES)
def test_the_kernel_compiles_for_a_hopper_gpu(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """What the interpreter does not check (types, tl.dot's shapes, constexpr branches as the compiler sees
    them), checked by compiling the kernels as the launcher would launch them for sm_90, without a GPU: in
    one split, and in three with the merge."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = []

    class Recorder:
        def __init__(self, kernel: Any) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
            return lambda *args, **options: launches.append((self.kernel, args, options))

    for kernel in ("_attend", "_merge"):
        monkeypatch.setattr(triton_attention, kernel, Recorder(getattr(triton_attention, kernel)))
    monkeypatch.setattr(triton_attention, "interpreting", lambda: False)  # as the kernels they stand for say
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    case = CASES[name]
    q = torch.zeros(6, case.heads, case.head_dim, dtype=case.dtype)
    kv = make_step(case, "cpu")
    for splits in (1, 3):
        kernel_call(triton_attention.paged_attention, q, kv, splits=splits)
    assert [kernel.__name__ for kernel, _, _ in launches] == ["_attend", "_attend", "_merge"]
    for kernel, args, options in launches:
        fp_fusion = options.pop("enable_fp_fusion")
        names = [n for n in kernel.arg_names if n not in options]
        signature = {n: triton.runtime.jit.mangle_type(a) for n, a in zip(names, args, strict=True)}
        signature |= dict.fromkeys(options, "constexpr")
        compiled = triton.compile(ASTSource(kernel, signature, options), target=GPUTarget("cuda", 90, 32),
                                  options={"enable_fp_fusion": fp_fusion})
        assert compiled.asm["cubin"]


@pytest.mark.cuda
@CUDA
@COMPILED
@pytest.mark.parametrize("name", CASES)
def test_the_compiled_kernel_attends_like_the_reference(name: str) -> None:
    check(CASES[name], triton_attention.paged_attention, "cuda")


@pytest.mark.cuda
@CUDA
@COMPILED
@pytest.mark.parametrize("splits", [1, 3])  # the one-kernel launch; the split one, its workspace and merge
def test_the_kernel_is_captured_in_a_cuda_graph(splits: int) -> None:
    """A captured launch replays over the tensors' new contents (queries, pages, positions), as it must in a
    captured decode step: nothing of them was read on the host."""
    case = CASES["int8-gqa8"]
    kv = make_step(case, "cuda")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, case.heads, case.head_dim, generator=gen).cuda()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel_call(triton_attention.paged_attention, q, kv, splits=splits)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel_call(triton_attention.paged_attention, q, kv, splits=splits)
    q.copy_(torch.randn(q.shape, generator=gen))
    kv.storage.segments(0)[0].scales.mul_(2)  # type: ignore[union-attr]
    kv.row_pos[:3] -= 1  # the verification rows one position earlier
    graph.replay()
    assert (out - kernel_call(triton_attention.paged_attention, q, kv, splits=splits)).abs().max() == 0


def test_a_process_on_the_cpu_never_imports_triton() -> None:
    """Importing Triton costs a process about 0.2 s: only a GPU's engine loads the kernel."""
    code = ("import sys; from kiln.config import EngineConfig; import kiln.llm, kiln.models.attention; "
            "EngineConfig(device='cpu').platform.paged_attention; print('triton' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.strip() == "False", done.stderr
