"""Fixtures of the fault-injection tests: the tiny model every node serves, the in-process reference run,
and how many kill trials to make (KILN_FAULT_TRIALS: `make fault` asks for many more than `make test`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.fault.node import Model
from tests.fault.verify import Reference
from tests.server.conftest import servers_root  # noqa: F401 - the model directories and weight cache the server tests share


def trials(default: int) -> int:
    """How many kill trials a test makes: KILN_FAULT_TRIALS when set, else its `make test` share."""
    return int(os.environ.get("KILN_FAULT_TRIALS", default))


@pytest.fixture(scope="session")
def model(servers_root) -> Model:  # noqa: F811 - the fixture imported above
    return Model.under(servers_root)


@pytest.fixture(scope="session")
def reference(model) -> Iterator[Reference]:
    made = Reference(model)
    yield made
    made.close()
