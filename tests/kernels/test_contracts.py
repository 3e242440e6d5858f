"""The kernels check every index they address memory with (kernels/checks.h): a broken contract from the
caller is kiln.errors.InvariantViolation, which fails the requests of that step, not a segfault or a silent
read out of bounds. The calls run in a subprocess (tests/kernels/bad_calls.py says why)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.errors import InvariantViolation
from kiln.kernels import kernels, supported
from tests.kernels import bad_calls
from tests.kernels.processes import ROOT

pytestmark = pytest.mark.skipif(not supported(), reason="Kiln's CPU kernels do not run here")


def test_broken_index_contracts_are_typed_errors_not_crashes() -> None:
    done = subprocess.run([sys.executable, "-m", "tests.kernels.bad_calls"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"the calls crashed (status {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    outcomes = dict(line.split("\t") for line in done.stdout.splitlines())
    expected = {case: "ok" if case == bad_calls.VALID else "InvariantViolation" for case in bad_calls.CASES}
    assert outcomes == expected


def test_the_error_names_the_broken_index_and_carries_a_bug_id() -> None:
    with pytest.raises(InvariantViolation, match=r"block_table\[2\] = 1000000000 lies outside \[0, 4\)") as caught:
        bad_calls.attention(table=((2, 0, bad_calls.HUGE),))
    assert caught.value.kind == "kernel_contract"
    assert caught.value.bug_id.startswith("KILN-KERNEL_CONTRACT-")
    assert kernels().page_format()  # the extension still works after a refused call
