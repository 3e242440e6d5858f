"""OpenMP's wait policy for this process: passive, so that torch's OpenMP workers sleep between parallel
regions instead of spinning beside the kernels' own spinning workers (kernels/pool.h).

libgomp (torch's OpenMP) keeps its workers spinning after every parallel region while the process has no
more OpenMP threads than cores. Spinning beside the kernels' pool they oversubscribe the cores: a
128-token prefill of the embedded model took 2.5x as long on the 2-core machine (bench/README § Design
figures). libgomp reads OMP_WAIT_POLICY once, when torch loads it, so `kiln` sets it on import, before
anything of Kiln imports torch; a caller's own setting wins. A program that imported torch before kiln
keeps libgomp's default, and the engine says so in a warning.
"""

from __future__ import annotations

import logging
import os
import sys

WAIT_POLICY = "OMP_WAIT_POLICY"
_SET_TOO_LATE = "torch" in sys.modules and WAIT_POLICY not in os.environ  # this module loads with `kiln`
# Whether the setting is Kiln's own: child processes inherit the environment, and another program's OpenMP
# (llama.cpp's, say) would sleep at every barrier under it (bench/common.py peer_environment).
SET_BY_KILN = WAIT_POLICY not in os.environ
os.environ.setdefault(WAIT_POLICY, "PASSIVE")

logger = logging.getLogger(__name__)


def warn_if_set_too_late() -> None:
    """A warning when torch was imported before kiln without OMP_WAIT_POLICY (see the module docstring)."""
    if _SET_TOO_LATE:
        logger.warning("torch was imported before kiln, so its OpenMP workers spin beside Kiln's kernels (prefill "
                       "up to 2.5x slower); set %s=PASSIVE in the environment, or import kiln first", WAIT_POLICY)
