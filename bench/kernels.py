"""Weight-format kernel candidates for CPU decode, measured on the embedded Gemma 3 270M's matrix shapes:
milliseconds per call at 1, 4, 16 and 256 input rows, and relative error against fp32.

Shapes: the LM head (262144 x 640, most of the bytes a decode step reads), the fused gate/up projection
(4096 x 640) and the down projection (640 x 2048). Weights are random normal (kernel speed does not
depend on values); the error is ||y - y_fp32|| / ||y_fp32|| on random normal inputs with a few outlier
channels, as Gemma's activations have. Each figure is the median of `--repeats` calls after a warm-up;
each candidate's calls run back to back after two untimed ones, as a model makes them. (Candidates
taking turns call by call measured Kiln's kernel up to 2.4x slower than this, the down projection at 256
rows 7.7 against 3.2 ms: the thread pools of the candidate before it, OpenMP's or inductor's, still spun
on the 2 cores when it started; a pause before each call instead let the virtual CPUs idle, and small
calls then took up to 10x longer.)

Candidates: fp32 F.linear (MKL); fbgemm fp16 and fbgemm dynamic int8 (activations quantised per
tensor); aten's weight-only int8 (_weight_int8pack_mm) and int4 (_weight_int4pack_mm_for_cpu, groups of
32); inductor (torch.compile) of the weight-only int8 matmul; Kiln's int8 kernel (kiln/kernels:
int16 inputs, integer sums), and QuantizedLinear as the engine calls it. Writes bench/results/kernels.json
and .png.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from statistics import median
from time import perf_counter
from typing import Any

import common
import torch
import torch.nn.functional as F

from kiln.kernels import kernels
from kiln.models.quant import QuantizedLinear

SHAPES = {"lm_head": (262144, 640), "gate_up_proj": (4096, 640), "down_proj": (640, 2048)}


def candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    n, k = weight.shape
    int8 = QuantizedLinear.quantize(weight, None, "int8")
    rows8 = torch.round(int8.dequantized() / int8.scale[:, None]).to(torch.int8)  # row-major, as aten and inductor take it
    ext = kernels()
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    fp16 = torch.ops.quantized.linear_prepack_fp16(weight, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q8 = torch.quantize_per_channel(weight, int8.scale.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
    dyn8 = torch.ops.quantized.linear_prepack(q8, None)
    torch.backends.quantized.engine = previous
    groups = weight.view(n, k // 32, 32)
    scale4 = groups.abs().amax(2) / 7
    q4 = (torch.round(groups / scale4[..., None]).clamp(-8, 7) + 8).to(torch.int32).view(n, k)
    aten4 = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
    scale_zero = torch.stack([scale4.T, -8 * scale4.T], dim=2).contiguous()  # [k/32, n, 2]: w = (q - 8) * s
    woq = torch.compile(lambda x, w, s: F.linear(x, w.float()) * s, dynamic=False)
    return {
        "fp32 (MKL)": lambda x: F.linear(x, weight),
        "fbgemm fp16": lambda x: torch.ops.quantized.linear_dynamic_fp16(x, fp16),
        "fbgemm dynamic int8": lambda x: torch.ops.quantized.linear_dynamic(x, dyn8),
        "aten int8 weight-only": lambda x: torch._weight_int8pack_mm(x, rows8, int8.scale),
        "aten int4 weight-only": lambda x: torch._weight_int4pack_mm_for_cpu(x, aten4, 32, scale_zero),
        "inductor int8 weight-only": lambda x: woq(x, rows8, int8.scale),
        "kiln int8 kernel": lambda x: ext.linear_int8(x, int8.weight, int8.scale, None),
        "kiln int8 (QuantizedLinear)": int8,
    }


def inputs(rows: int, k: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, :4] *= 30  # outlier channels
    return x


def measure(shape: tuple[int, int], rows_list: list[int], repeats: int) -> dict[str, Any]:
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.02
    funcs = candidates(weight)
    out: dict[str, Any] = {}
    for rows in rows_list:
        x = inputs(rows, shape[1])
        reference = F.linear(x, weight)
        times: dict[str, list[float]] = {name: [] for name in funcs}
        errors: dict[str, float | str] = {}
        for name, fn in funcs.items():
            try:
                y = fn(x)  # warm-up (and compile)
                errors[name] = float((y - reference).norm() / reference.norm())
            except Exception as error:  # a candidate that does not run here is recorded, not hidden
                errors[name] = f"{type(error).__name__}: {error}"[:200]
        runnable = [name for name in funcs if isinstance(errors[name], float)]
        for name in runnable:
            for _ in range(2):
                funcs[name](x)
            for _ in range(repeats):
                start = perf_counter()
                funcs[name](x)
                times[name].append(1e3 * (perf_counter() - start))
        out[str(rows)] = {
            name: {"ms": median(times[name]) if name in runnable else None, "relative_error": errors[name]} for name in funcs
        }
        print(shape, rows, {n: round(v["ms"], 2) for n, v in out[str(rows)].items() if v["ms"] is not None}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=common.ints, default=[1, 4, 16, 256])
    parser.add_argument("--repeats", type=int, default=7)
    args = common.parse_run_args(parser, "kernels", "2 repeats, rows 1 and 4", _quick)
    _, machine, _ = common.start("kiln")
    results = {
        name: measure(shape, [r for r in args.rows if name != "lm_head" or r <= 16], args.repeats)
        for name, shape in SHAPES.items()
    }
    payload = {"method": __doc__, "settings": vars(args), "machine": machine, "results": results}
    print("wrote", common.write_results(args.name, payload))
    plot(args.name, results)


def _quick(args: argparse.Namespace) -> None:
    args.repeats, args.rows = 2, [1, 4]


def plot(name: str, results: dict[str, Any]) -> None:
    panels = []
    for shape, by_rows in results.items():
        rows = list(by_rows)
        names = list(by_rows[rows[0]])
        panels.append((f"{shape}: ms per call", [f"{r} rows" for r in rows],
                       {n: [by_rows[r][n]["ms"] for r in rows] for n in names}))
    common.plot_bars(name, panels, "Kernel candidates on the embedded model's shapes (2 threads, median)")


if __name__ == "__main__":
    main()
