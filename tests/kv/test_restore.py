"""`restore` equals `full`: the real KVCache (with host and disk tiers) and ModelRunner on tiny llama and
gemma3, prefill and decode across page boundaries, after many evictions (pages moved down to disk),
with a second sequence reading the first one's tier pages through the prefix cache and a fork; and
`sink_window` keeps exactly the documented pages resident."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.runner import Chunk, ModelRunner
from kiln.engine.sequence import Sequence
from kiln.kernels.page_format import CHUNK_TOKENS
from kiln.kv.cache import KVCache
from kiln.kv.codec import KVCodec
from kiln.kv.format import KVFormat
from kiln.kv.layout import KVLayout
from kiln.kv.pages import PageTable
from kiln.kv.policy import FULL, KVPolicy
from kiln.kv.tiers import PageTiers
from kiln.models import build_model
from kiln.models.causal_lm import CausalLM
from kiln.models.config import ModelConfig
from tests.tiny_models import TINY_CONFIGS, hf_state_dict, tiny_hf_model

PS = 8


def assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 of the largest logit: streamed attention sums in another order, and the tiny random
    gemma3's logits reach ~75, where one float32 ulp is already 7.6e-6."""
    assert (got - expected).abs().max().item() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


class Harness:
    """One model over one KVCache of `num_pages` pages of `page_size` tokens (tiers: `host_pages` pages of
    host memory, then disk) and a runner streaming `stream_pages` pages at a time. `arch` names a tiny
    model, or pass `model` and `config`."""

    def __init__(self, arch: str | None, tmp_path, host_pages: int = 4, disk_pages: int = 4096, stream_pages: int = 3,
                 codec: str = "none", model: CausalLM | None = None, config: ModelConfig | None = None,
                 page_size: int = PS, num_pages: int = 512) -> None:
        if arch is not None:
            config = TINY_CONFIGS[arch]
            model = build_model(config)
            model.load_weights(hf_state_dict(tiny_hf_model(arch)))
        self.model = model
        layout = KVLayout.for_model(config, page_size)
        kv_codec = KVCodec(codec, layout, torch.float32)
        self.tiers = PageTiers(kv_codec, host_pages * kv_codec.page_nbytes, str(tmp_path), disk_pages * kv_codec.page_nbytes)
        kv_format = KVFormat("test", "float32", "float32", codec, page_size)
        self.cache = KVCache(layout, num_pages, kv_codec, "cpu", kv_format, self.tiers)
        self.runner = ModelRunner(self.model, self.cache.storage, tiers=self.tiers, stream_pages=stream_pages)
        self.streamed_steps = 0

    def admit(self, tokens: list[int], policy: KVPolicy) -> Sequence:
        seq = Sequence(tokens, PageTable.empty(self.cache.layout.num_groups, policy))
        seq.num_computed = self.cache.attach(seq.table, tokens)
        return seq

    def feed(self, seq: Sequence, chunks: list[int]) -> torch.Tensor:
        """Logits [sum(chunks), vocab] of each fed position, one step per chunk (INV-1 checked after each)."""
        out = []
        for n in chunks:
            assert self.cache.ensure(seq.table, seq.num_computed + n)
            inputs = self.runner.prepare([Chunk(seq, n, logit_rows=n)])
            kv = inputs.attention.kv
            streams = [kv.streams(layer) for layer in range(len(kv.layer_slots))]
            # Only global layers stream; sliding-window ones attend as usual (bounded by their window).
            assert all(not streamed for layer, streamed in enumerate(streams) if self.cache.layout.groups[kv.layer_slots[layer][0]].window)
            self.streamed_steps += any(streams)
            out.append(self.runner.run(inputs))
            seq.num_computed += n
            self.cache.commit(seq.table, seq.tokens, seq.num_computed)
            self.cache.check(seq.table, seq.tokens, seq.num_computed)
        return torch.cat(out)

    def global_resident(self, seq: Sequence) -> list[list[int]]:
        """Indices of resident pages of each global group."""
        return [[i for i, page in enumerate(pages) if page is not None]
                for group, pages in zip(self.cache.layout.groups, seq.table.pages, strict=True) if group.window is None]


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


RESTORE = KVPolicy("restore", sink_tokens=8, window_tokens=24)
CHUNKS = [37, 29, 40] + [1] * 30  # prefill chunks ending mid-page, then decode across page boundaries


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_restore_logits_equal_full_after_many_evictions(arch, tmp_path):
    history = tokens(sum(CHUNKS))
    full = Harness(arch, tmp_path)
    expected = full.feed(full.admit(history, FULL), CHUNKS)
    restored = Harness(arch, tmp_path)
    seq = restored.admit(history, RESTORE)
    got = restored.feed(seq, CHUNKS)
    assert_close(got, expected)
    usage = restored.tiers.usage()
    assert usage.pages["disk"] > 0 and usage.pages["host"] == 4  # evicted pages moved down to disk
    assert restored.streamed_steps == len(CHUNKS) and full.streamed_steps == 0  # restore always streams
    limit = RESTORE.resident_limit(PS)
    assert all(len(resident) <= limit for resident in restored.global_resident(seq))


def test_prefix_sharing_sequences_read_each_others_tier_pages(tmp_path):
    history = tokens(150, seed=3)
    reference = Harness("gemma3", tmp_path)
    expected = reference.feed(reference.admit(history, FULL), [140, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    harness = Harness("gemma3", tmp_path)
    first = harness.admit(history[:140], RESTORE)
    harness.feed(first, [140])
    tier_pages = sum(harness.tiers.usage().pages.values())
    filler = PageTable.empty(harness.cache.layout.num_groups)  # evicts every cached pool page
    assert harness.cache.ensure(filler, harness.cache.available() // harness.cache.layout.num_groups * PS)
    harness.cache.release(filler)
    second = harness.admit(history, RESTORE)  # shares the first one's pages: pool (resident) and tier
    assert second.num_computed == 136 and any(second.table.tiered)
    shared = [(g, second.table.hashes[i]) for g, indices in enumerate(second.table.tiered) for i in indices]
    assert all(harness.tiers.references(key) == 2 for key in shared)
    got = harness.feed(second, [4, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    assert_close(got[-10:], expected[-10:])
    assert sum(harness.tiers.usage().pages.values()) == tier_pages + 1  # only page 17 is new in the tier
    child_table, computed = harness.cache.fork(second.table, second.num_computed, second.tokens)
    child = Sequence(list(second.tokens), child_table, num_computed=computed)
    child.tokens.append(7)
    second.tokens.append(7)
    assert (harness.feed(child, [1]) - harness.feed(second, [1])).abs().max().item() == 0
    for seq in (first, second, child):
        harness.cache.release(seq.table)
    assert harness.tiers.references() == 0
    assert harness.cache.usage().used == 0


def test_rollback_releases_tier_pages_it_no_longer_covers(tmp_path):
    harness = Harness("llama", tmp_path)
    seq = harness.admit(tokens(120), RESTORE)
    harness.feed(seq, [120])
    held = harness.tiers.references()
    seq.num_computed = harness.cache.drop(seq.table, 119)
    harness.cache.check(seq.table, seq.tokens, seq.num_computed)
    assert harness.tiers.references() == held
    harness.cache.release(seq.table)
    assert harness.tiers.references() == 0


def test_a_full_tier_keeps_pages_resident_instead_of_losing_them(tmp_path):
    expected_harness = Harness("llama", tmp_path)
    history = tokens(100, seed=5)
    expected = expected_harness.feed(expected_harness.admit(history, FULL), [60, 40])
    harness = Harness("llama", tmp_path, host_pages=1, disk_pages=1)
    seq = harness.admit(history, RESTORE)
    got = harness.feed(seq, [60, 40])
    assert sum(harness.tiers.usage().pages.values()) == 2  # both tiers full of referenced pages
    assert max(len(r) for r in harness.global_resident(seq)) > RESTORE.resident_limit(PS)  # overflow stays resident
    assert_close(got, expected)


def test_lossy_codec_in_the_tier_changes_logits_a_little(tmp_path):
    history = tokens(100, seed=6)
    exact = Harness("llama", tmp_path)
    expected = exact.feed(exact.admit(history, FULL), [100])[-1]
    coded = Harness("llama", tmp_path, codec="int8")
    got = coded.feed(coded.admit(history, RESTORE), [60, 40])[-1]
    difference = (got - expected).abs().max().item()
    assert 0 < difference < 0.05 * expected.abs().max().item()


def test_sink_window_keeps_exactly_the_documented_pages(tmp_path):
    policy = KVPolicy("sink_window", sink_tokens=10, window_tokens=20)  # sink: 2 pages; window: 20 tokens
    harness = Harness("llama", tmp_path)
    seq = harness.admit(tokens(90), policy)
    for step, n in enumerate([23] + [1] * 67):
        harness.feed(seq, [n])
        computed = seq.num_computed
        # commit keeps one page of slack: the window of a query at computed - PS
        first_window_page = max(0, computed - PS - 20 + 1) // PS
        expected = sorted(set(range(min(2, first_window_page))) | set(range(first_window_page, -(-computed // PS))))
        assert harness.global_resident(seq) == [expected], step
        assert len(expected) <= policy.resident_limit(PS)
    assert not any(seq.table.tiered) and sum(harness.tiers.usage().pages.values()) == 0


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_the_kernel_and_pytorch_paths_agree_on_tier_pages(codec, tmp_path):
    """Steps that attend in place merge pool, host-tier and disk-tier pages in the kernel; the others (and
    every step without the kernels) stream chunks through PyTorch: the same logits, in every codec."""
    history = tokens(160, seed=8)
    chunks = [100, 30] + [1] * 30  # a step too long to attend in place, then in-place steps
    kernel = Harness("gemma3", tmp_path, codec=codec)
    if not kernel.runner.kernel_attention:
        pytest.skip("Kiln's CPU kernels are unavailable here: only the PyTorch path runs")
    got = kernel.feed(kernel.admit(history, RESTORE), chunks)
    usage = kernel.tiers.usage()
    assert usage.pages["host"] > 0 and usage.pages["disk"] > 0
    pytorch = Harness("gemma3", tmp_path, codec=codec)
    pytorch.runner.kernel_attention = False
    assert_close(got, pytorch.feed(pytorch.admit(history, RESTORE), chunks))


def test_tier_runs_attend_host_pages_in_place_and_stage_disk_chunks(tmp_path):
    """A step's tier reads: every tier page once, in position order; a run with disk pages is staged and
    lies within one of the kernel's chunks (CHUNK_TOKENS positions); host pages are read where they lie."""
    harness = Harness("gemma3", tmp_path, host_pages=40, stream_pages=3)
    seq = harness.admit(tokens(700, seed=9), RESTORE)
    harness.feed(seq, [60] * 11)
    assert harness.cache.ensure(seq.table, seq.num_computed + 1)
    kv = harness.runner.prepare([Chunk(seq, 1, logit_rows=1)]).attention.kv
    (runs,) = kv.tier_runs(0)
    starts = [int(p) for run in runs for p in run.first_pos[0]]
    assert starts == [i * PS for i in sorted(seq.table.tiered[0])]
    staged = [run for run in runs if run.host_slots is None]
    in_place = [run for run in runs if run.host_slots is not None]
    assert staged and in_place and len(in_place) == 1  # the host pages are the latest evicted: one run
    assert all(len({int(p) // CHUNK_TOKENS for p in run.first_pos[0]}) == 1 for run in staged)
    assert all(tier == "host" for tier, _ in in_place[0].places)
