"""The page format's constants are defined once per language (kernels/page_format.h, kiln/kernels/page_format.py)
and agree; EngineConfig takes exactly the page sizes the attention kernels serve."""

from __future__ import annotations

import pytest

from kiln.config import EngineConfig
from kiln.errors import InvalidArgumentError
from kiln.kernels import kernels, page_format, supported


@pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run here")
def test_python_and_cpp_agree_on_the_page_format() -> None:
    assert kernels().page_format() == {
        "tiny_scale": page_format.TINY_SCALE,
        "int8_max": page_format.INT8_MAX,
        "int4_max": page_format.INT4_MAX,
        "chunk_tokens": page_format.CHUNK_TOKENS,
        "max_page_tokens": page_format.MAX_PAGE_TOKENS,
    }


def test_page_sizes_are_the_powers_of_two_the_kernels_serve() -> None:
    assert page_format.PAGE_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    for size in page_format.PAGE_SIZES:
        assert EngineConfig(page_size=size).page_size == size


@pytest.mark.parametrize("size", [24, 512, 0, -16, 3, 16.0, True])
def test_other_page_sizes_are_refused_naming_the_allowed_ones(size: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"page_size must be one of 1, 2, 4, 8, 16, 32, 64, 128, 256 .*got"):
        EngineConfig(page_size=size)  # type: ignore[arg-type]
