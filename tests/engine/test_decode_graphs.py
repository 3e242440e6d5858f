"""Decode steps over static, padded buffers (kiln/engine/decode_graphs.py): what a GPU captures as CUDA graphs,
run eagerly on the CPU against the dynamic step over the same pages; plus the engine choosing it, and its
refusals (steps that must stay eager)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kiln import SamplingParams
from kiln.config import EngineConfig
from kiln.engine.decode_graphs import DecodeBucket, bucket_sizes
from kiln.engine.runner import Chunk, ModelRunner, StepInputs
from kiln.errors import InvalidArgumentError
from kiln.kernels import supported as kernels_supported
from kiln.models import build_model
from tests.models.test_host_reads import host_reads
from tests.models.test_parity import PoisonedCache, random_tokens
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, random_hf_model

ARCHITECTURES = ("llama", "qwen2", "gemma3")  # plain, biases + sliding windows, windows + q/k norms
# The model's PyTorch ops over gathered pages (a GPU's path without the Triton kernel); the ops attending in place
# (the C++ kernel); the CPU kernels' fused layers.
PATHS = ["gathered"] + (["ops", "kernels"] if kernels_supported() else [])


def test_buckets_double_up_to_max_num_seqs_which_is_one_too() -> None:
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(6) == [1, 2, 4, 6]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(200) == [1, 2, 4, 8, 16, 32, 64, 128, 200]


def test_config_refuses_graphs_with_the_deterministic_mode_and_a_non_boolean() -> None:
    if kernels_supported():
        with pytest.raises(InvalidArgumentError, match="decode_graphs"):
            EngineConfig(deterministic=True, decode_graphs=True)
    with pytest.raises(InvalidArgumentError, match="decode_graphs"):
        EngineConfig(decode_graphs="yes")  # type: ignore[arg-type]
    assert EngineConfig().decode_graphs is False  # the CPU captures nothing by default
    assert EngineConfig().dtype == "float32"


def setup(arch: str, path: str, num_tokens: int, max_num_seqs: int = 8) -> tuple[PoisonedCache, ModelRunner]:
    """A poisoned pool (a page read that should not be turns logits into NaN) with a dynamic runner, and a second
    runner over the same pool whose decode steps take the static buffers."""
    config = TINY_CONFIGS[arch]
    model = build_model(config)
    model.load_weights(hf_state_dict(random_hf_model(config)))
    if path == "kernels":
        model.use_kernels()
    paged = PoisonedCache(model, config, 4, num_tokens)
    static = ModelRunner(model, paged.cache.storage)
    static.use_decode_graphs(max_num_seqs, 128, paged.cache.reserve_page(), capture=False)
    if path == "gathered":
        paged.runner.kernel_attention = static.kernel_attention = False
    return paged, static


def _in_bucket(inputs: StepInputs, size: int) -> None:
    assert inputs.decode is not None and inputs.decode.size == size


def decode_chunks(paged: PoisonedCache, seqs: list) -> list[Chunk]:
    """A decode step's chunks, one new token per sequence, their pages ensured (a new page holding finite
    garbage, as a reused page does)."""
    data = paged.cache.storage.data
    for seq in seqs:
        held = set(seq.table.resident())
        assert paged.cache.ensure(seq.table, seq.num_computed + 1)
        for page in set(seq.table.resident()) - held:
            data[page] = paged.codec.encode(torch.randn(paged.block_shape, generator=paged.generator))
    return [Chunk(seq, 1) for seq in seqs]


def decode_alike(
    paged: PoisonedCache, static: ModelRunner, seqs: list, steps: int, tolerance: float,
    check: Callable[[StepInputs], None] = lambda inputs: None,
) -> None:
    """`steps` decode steps of `seqs`, each run dynamically and then statically (its inputs first held to `check`)
    over the same pages, which both write identically: their logits agree."""
    for step in range(steps):
        chunks = decode_chunks(paged, seqs)
        dynamic = paged.runner.run(paged.runner.prepare(chunks)).clone()
        inputs = static.prepare(chunks)
        check(inputs)
        logits = static.run(inputs)
        assert logits.shape == dynamic.shape and torch.isfinite(logits).all()
        torch.testing.assert_close(logits, dynamic, rtol=tolerance, atol=tolerance, msg=f"step {step}")
        for seq in seqs:
            seq.num_computed += 1
            paged.cache.commit(seq.table, seq.tokens, seq.num_computed)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_static_decode_gives_the_dynamic_steps_logits(arch: str, path: str) -> None:
    """Three sequences of different lengths prefilled, then decoded token by token across pages (and windows):
    each decode step runs dynamically and then statically (padded to the bucket of 4) over the same pages,
    which both write identically; their logits agree."""
    paged, static = setup(arch, path, 3 * 60)
    seqs = [paged.admit(random_tokens(length, seed=length)) for length in (37, 20, 45)]
    for seq, n in zip(seqs, (30, 13, 38), strict=True):
        paged.step([(seq, n)])
    decode_alike(paged, static, seqs, 7, 1e-5, lambda inputs: _in_bucket(inputs, 4))


def test_every_bucket_and_a_lone_sequence_agree() -> None:
    """One sequence (bucket 1, no padding) and five (bucket 8: three padding rows)."""
    paged, static = setup("gemma3", "ops", 5 * 30)
    seqs = [paged.admit(random_tokens(20 + i, seed=i)) for i in range(5)]
    for seq in seqs:
        paged.step([(seq, len(seq.tokens) - 1)])
    for group in ([seqs[0]], seqs):
        chunks = decode_chunks(paged, group)
        inputs = static.prepare(chunks)
        assert inputs.decode is not None and inputs.decode.size == {1: 1, 5: 8}[len(group)]
        torch.testing.assert_close(static.run(inputs), paged.runner.run(paged.runner.prepare(chunks)), rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_plain_decode_stay_dynamic() -> None:
    paged, static = setup("llama", "ops", 3 * 40, max_num_seqs=2)
    seqs = [paged.admit(random_tokens(30, seed=i)) for i in range(3)]
    paged.step([(seqs[0], 10)])
    assert paged.cache.ensure(seqs[0].table, seqs[0].num_computed + 5)
    assert static.prepare([Chunk(seqs[0], 5)]).decode is None  # a prefill chunk
    assert static.prepare([Chunk(seqs[0], 2, logit_rows=2, draft=[7])]).decode is None  # speculative verification
    for seq in seqs[1:]:
        paged.step([(seq, 10)])
    assert static.prepare(decode_chunks(paged, seqs)).decode is None  # more rows than the largest bucket
    assert static.prepare([Chunk(seqs[0], 1)]).decode is not None


def test_padding_rows_write_only_the_scratch_page() -> None:
    """Three sequences in the bucket of 4: the pages that change are the sequences' own and the scratch page."""
    paged, static = setup("llama", "ops", 3 * 30)
    seqs = [paged.admit(random_tokens(20, seed=i)) for i in range(3)]
    for seq in seqs:
        paged.step([(seq, 19)])
    inputs = static.prepare(decode_chunks(paged, seqs))
    assert inputs.decode is not None and inputs.decode.size == 4
    data = paged.cache.storage.data
    before = data.clone()
    static.run(inputs)
    changed = {page for page in range(len(data)) if not torch.equal(data[page], before[page])}
    assert inputs.decode.scratch in changed
    assert changed <= {page for seq in seqs for page in seq.table.resident()} | {inputs.decode.scratch}


def test_a_static_decode_step_reads_nothing_back_on_the_host() -> None:
    """The PyTorch path (what a GPU captures without its Triton kernel): no value read back, so it can be captured."""
    paged, static = setup("gemma3", "gathered", 3 * 40)
    seqs = [paged.admit(random_tokens(25, seed=i)) for i in range(3)]
    for seq in seqs:
        paged.step([(seq, 24)])
    inputs = static.prepare(decode_chunks(paged, seqs))
    with host_reads() as seen:
        static.run(inputs)
    assert seen == []


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_an_engine_with_static_decode_generates_what_the_dynamic_one_does(tiny_llm, arch: str, monkeypatch) -> None:
    runs = []
    original = DecodeBucket.run
    monkeypatch.setattr(DecodeBucket, "run", lambda self, *args: runs.append(self.size) or original(self, *args))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [random_tokens(n, seed=n) for n in (9, 21, 14)]
    dynamic = tiny_llm(arch, speculative=None).generate(prompts, params)
    llm = tiny_llm(arch, speculative=None, decode_graphs=True, max_num_seqs=4)
    static = llm.generate(prompts, params)
    assert [r.token_ids for r in static] == [r.token_ids for r in dynamic]
    assert runs and set(runs) <= {1, 2, 4}
    assert llm.engine.decode_graphs is not None and llm.engine.decode_graphs.capture_s == 0.0  # nothing captured on a CPU


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu.py runs these there)")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_captured_graphs_replay_the_dynamic_steps_logits_on_a_gpu(arch: str, monkeypatch) -> None:
    """The graphs themselves: captured per bucket, replayed over the buffers a step filled."""
    monkeypatch.setattr("tests.models.test_parity.DEVICE", "cuda")
    config = TINY_CONFIGS[arch]
    model = build_model(config, device="cuda")
    model.load_weights(hf_state_dict(random_hf_model(config)))
    paged = PoisonedCache(model, config, 4, 3 * 60)
    static = ModelRunner(model, paged.cache.storage)
    graphs = static.use_decode_graphs(4, 128, paged.cache.reserve_page(), capture=True)
    assert all(bucket.graph is not None for bucket in graphs.buckets) and graphs.capture_s > 0
    seqs = [paged.admit(random_tokens(length, seed=length)) for length in (37, 20, 45)]
    for seq, n in zip(seqs, (30, 13, 38), strict=True):
        paged.step([(seq, n)])
    decode_alike(paged, static, seqs, 5, 1e-4)


@pytest.mark.cuda
@CUDA
def test_an_engine_on_a_gpu_captures_at_start_and_runs_ahead_with_the_eager_engines_tokens(tiny_llm) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [random_tokens(n, seed=n) for n in (9, 21, 14)]
    eager = tiny_llm("llama", device="cuda", dtype="float32", speculative=None, decode_graphs=False).generate(prompts, params)
    llm = tiny_llm("llama", device="cuda", dtype="float32", speculative=None, max_num_seqs=4)
    assert llm.config.decode_graphs and llm.config.async_scheduling
    assert llm.engine.decode_graphs is not None and llm.engine.decode_graphs.capture_s > 0
    assert [r.token_ids for r in llm.generate(prompts, params)] == [r.token_ids for r in eager]
