"""The soak (bench/soak.py) for two minutes: 16 agents, forks, closes, cancels, TTL evictions and two
graceful restarts against a real `kiln serve`; `make soak` runs the full 30 minutes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
RSS_GROWTH_BOUND = 256 * 2**20  # generous: a leak of a page or a request per turn would pass it within minutes


def test_two_minute_soak_loses_nothing_and_stays_flat(tmp_path):
    run = subprocess.run([sys.executable, str(SOAK), "--minutes", "2", "--results-dir", str(tmp_path), "--name", "soak"],
                         capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["sessions_lost"] == 0, result["lost"]
    assert sum(result["invariant_violations"].values()) == 0, result["invariant_violations"]
    assert result["generations"].get("error", 0) == 0, result["generations"]
    assert result["reference_checks"] > 0 and result["reference_mismatches"] == [], result["reference_mismatches"]
    assert {error for error in result["errors"] if error.startswith("unexpected:")} == set(), result["errors"]
    assert len(result["restarts"]) == 2 and result["session_evictions"].get("ttl", 0) > 0
    assert result["rss_growth_after_warmup_bytes"] is not None
    assert result["rss_growth_after_warmup_bytes"] < RSS_GROWTH_BOUND
