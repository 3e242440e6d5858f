"""kiln sets OpenMP's passive wait policy before torch loads libgomp (kiln/openmp.py), keeps a caller's
own, and warns when torch was imported first, since libgomp then keeps its spinning default."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WARNING = "torch was imported before kiln"


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


def test_importing_kiln_first_makes_openmp_passive_before_torch_loads_it():
    done = run("import kiln, os, sys; from kiln.llm import LLM; from kiln.openmp import warn_if_set_too_late; "
               "warn_if_set_too_late(); print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    assert done.stdout.split() == ["PASSIVE", "True"]  # torch loaded after the policy was set
    assert WARNING not in done.stderr


@pytest.mark.parametrize("first", ["import torch, kiln", "import kiln"])
def test_a_callers_own_policy_is_kept_and_not_warned_about(first):
    done = run(f"{first}, os; from kiln.openmp import warn_if_set_too_late; warn_if_set_too_late(); "
               "print(os.environ['OMP_WAIT_POLICY'])", OMP_WAIT_POLICY="ACTIVE")
    assert done.stdout.strip() == "ACTIVE"
    assert WARNING not in done.stderr


def test_torch_imported_first_is_warned_about():
    done = run("import torch, kiln, logging; logging.basicConfig(); "
               "from kiln.openmp import warn_if_set_too_late; warn_if_set_too_late()")
    assert WARNING in done.stderr and "OMP_WAIT_POLICY=PASSIVE" in done.stderr
