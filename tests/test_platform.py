"""kiln/platform.py: what each device can do, decided in one place, and EngineConfig resolving its defaults
and refusals from it: a CPU with the kernels, one without (a simulated failed build), a GPU (named only:
nothing here needs one), a malformed device."""

from __future__ import annotations

import pytest
import torch

import kiln.kernels
from kiln.config import EngineConfig
from kiln.errors import InvalidArgumentError
from kiln.platform import Platform

pytestmark = pytest.mark.skipif(not kiln.kernels.supported(), reason="Kiln's CPU kernels do not run on this machine")


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    library = kiln.kernels._Library()
    library._outcome = kiln.kernels._Outcome(None, "a simulated build failure")
    monkeypatch.setattr(kiln.kernels, "_library", library)


def test_a_cpu_with_the_kernels() -> None:
    cpu = Platform.of("cpu")
    assert (cpu.name, cpu.kernels, cpu.on_host) == ("cpu-kernels", True, True)
    assert Platform.of(torch.zeros(1).device) == cpu
    assert cpu.default_quantization(torch.float32) == "gguf" and cpu.default_quantization(torch.bfloat16) is None
    assert cpu.quantization_problem("int8", torch.float32) is None
    assert "float32 activations" in cpu.quantization_problem("gguf", torch.bfloat16)
    assert cpu.default_kv_dtype("gguf") == "float16" and cpu.default_kv_dtype(None) is None
    assert cpu.fused_kernels(torch.float32) and not cpu.fused_kernels(torch.bfloat16)
    assert cpu.kernel_pages(torch.float16) and cpu.kernel_pages(torch.float32) and not cpu.kernel_pages(torch.bfloat16)
    assert cpu.deterministic_problem(torch.float32, torch.float16) is None
    assert "deterministic needs" in cpu.deterministic_problem(torch.float32, torch.bfloat16)


def test_a_cpu_without_them(kernels_off: None) -> None:
    cpu = Platform.of("cpu")
    assert (cpu.name, cpu.kernels, cpu.on_host) == ("cpu", False, True)
    assert cpu.default_quantization(torch.float32) is None
    assert "a simulated build failure" in cpu.quantization_problem("int8", torch.float32)
    assert not cpu.fused_kernels(torch.float32) and not cpu.kernel_pages(torch.float16)
    assert cpu.deterministic_problem(torch.float32, torch.float32) is not None


def test_a_gpu() -> None:
    gpu = Platform.of("cuda:0")
    assert (gpu.name, gpu.kernels, gpu.on_host, gpu.device) == ("cuda", False, False, torch.device("cuda:0"))
    assert gpu.default_quantization(torch.float32) is None and gpu.default_kv_dtype(None) is None
    assert "not on 'cuda'" in gpu.quantization_problem("int8", torch.float32)
    assert not gpu.fused_kernels(torch.float32) and not gpu.kernel_pages(torch.float16)
    assert gpu.deterministic_problem(torch.float32, torch.float32) is not None


def test_engine_config_takes_its_defaults_and_refusals_from_the_platform() -> None:
    assert (EngineConfig().quantization, EngineConfig().kv_dtype, EngineConfig().fused_kernels) == ("gguf", "float16", True)
    gpu = EngineConfig(device="cuda", dtype="bfloat16")
    assert (gpu.quantization, gpu.kv_dtype, gpu.fused_kernels, gpu.platform.name) == (None, None, False, "cuda")
    with pytest.raises(InvalidArgumentError, match="quantization 'int8' runs on Kiln's CPU kernels, not on 'cuda'"):
        EngineConfig(device="cuda", quantization="int8")
    with pytest.raises(InvalidArgumentError, match="device must name a torch device"):
        EngineConfig(device="no such device")
