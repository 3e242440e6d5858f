"""`make peer-test`: a `kiln serve` of the embedded model for LangChain's standard suite, started once."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.server.conftest import start_server

URL_VARIABLE = "KILN_PEER_BASE_URL"  # where the suite's ChatOpenAI finds the server


@pytest.fixture(scope="session", autouse=True)
def kiln_server() -> Iterator[str]:
    handle = start_server(None, None, extra=("--kv-budget-mb", "512", "--served-model-name", "kiln-peer"))
    os.environ[URL_VARIABLE] = handle.http_url + "/v1"
    yield os.environ[URL_VARIABLE]
    handle.stop()
