"""The SDK is a thin gRPC client: importing it, or the core modules it shares with the server (chat
formatting, text deltas), must not pull in torch or the engine."""

import subprocess
import sys


def test_sdk_imports_without_torch_or_engine():
    probe = (
        "import sys, kiln.client, kiln.chat, kiln.text\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('kiln.engine', 'kiln.kv', 'kiln.models')))\n"
        "print(','.join(heavy))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
