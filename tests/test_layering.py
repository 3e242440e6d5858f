"""docs/architecture.md § Layers, enforced. Each module of kiln/ imports only its own layer and the layers
below it, as the table there places them: the table is read from the document, so the two cannot drift, and
a module it does not place fails. Beside the order, the rules the table states:
- the kernels import nothing of Kiln's but kiln/errors.py;
- the Python SDK (kiln.client) imports only the foundation, and no module imports the SDK but the CLI, a
  client itself (`kiln chat --server`).

Checked on the source with `ast`, so every form counts (`import kiln.x`, `from kiln.x.y import z`, `from kiln
import x`, relative imports, imports inside functions or under `if TYPE_CHECKING:`) and text in strings does not.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
SDK = "kiln.client"
CLIENTS = {"kiln.cli"}  # modules outside the SDK that are clients themselves
KERNELS = "kiln.kernels"
KERNEL_DEPENDENCIES = {"kiln.errors"}
FOUNDATION = "foundation"


def module_name(path: Path) -> str:
    """kiln/kv/codec.py -> kiln.kv.codec; kiln/kv/__init__.py -> kiln.kv."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in sorted((ROOT / "kiln").rglob("*.py"))}


def table_entry(path: str) -> str:
    """A path of the table as a dotted name: a package ends with "." (it holds every module under it)."""
    if path.endswith("/"):
        return path.rstrip("/").replace("/", ".") + "."
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def read_layers() -> list[tuple[str, list[str]]]:
    """(layer, its entries), top to bottom, from the table of docs/architecture.md § Layers."""
    section = DOC.read_text().split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ")][1:]  # [0]: the header
    return [(name.strip(), [table_entry(path) for path in re.findall(r"`(kiln/[^`]*)`", cell)]) for name, cell in rows]


LAYERS = read_layers()


def places(entry: str, module: str) -> bool:
    return module == entry or (entry.endswith(".") and (module + ".").startswith(entry))


def layer_of(module: str) -> int | None:
    """Index in LAYERS (0 = the top) of the layer the table puts `module` in; None where it puts it nowhere."""
    found = [index for index, (_, entries) in enumerate(LAYERS) for entry in entries if places(entry, module)]
    return found[0] if len(found) == 1 else None


def package_of(module: str) -> str:
    """The package that relative imports in `module` resolve against."""
    return module if MODULES.get(module, Path()).name == "__init__.py" else module.rpartition(".")[0]


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Every dotted name an import statement may load, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*parent, base] if base else parent)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]  # `from kiln import client`


def kiln_module(name: str) -> str | None:
    """The module of kiln/ that importing `name` loads (its longest prefix that is one): `kiln.kv.codec.Segment`
    is kiln.kv.codec, `kiln.__version__` is kiln. None outside kiln/."""
    parts = name.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in MODULES), None)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def why_forbidden(importer: str, imported: str) -> str | None:
    """The rule of the table that forbids `importer` to import `imported`, or None."""
    if within(imported, SDK) and not within(importer, SDK) and importer not in CLIENTS:
        return "no module imports the SDK but the CLI; move what it needs out of kiln.client"
    below, above = layer_of(imported), layer_of(importer)
    if below is None or above is None:
        return "the table places no layer for it"
    if within(importer, SDK) and not within(imported, SDK) and LAYERS[below][0] != FOUNDATION:
        return f"the SDK imports only the foundation, not the {LAYERS[below][0]} layer"
    if within(importer, KERNELS) and not within(imported, KERNELS) and imported not in KERNEL_DEPENDENCIES:
        return f"the kernels import nothing of Kiln's but {', '.join(sorted(KERNEL_DEPENDENCIES))}"
    if below < above:
        return f"the {LAYERS[above][0]} layer imports the {LAYERS[below][0]} layer, which is above it"
    return None


def violations(source: str, importer: str) -> list[str]:
    """'line: statement (the rule)' for each import in `source`, the text of module `importer`, that the table forbids."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            imported = {module for name in imported_names(node, package_of(importer)) if (module := kiln_module(name))}
            reasons = sorted({why for module in imported if (why := why_forbidden(importer, module))})
            if reasons:
                found.append(f"{node.lineno}: {ast.get_source_segment(source, node)} ({'; '.join(reasons)})")
    return found


def test_the_table_places_every_module_of_kiln_in_one_layer():
    unplaced = [module for module in MODULES if layer_of(module) is None]
    assert not unplaced, f"add these to one row of {DOC.name} § Layers: {unplaced}"


def test_every_module_the_table_names_exists():
    missing = [entry for _, entries in LAYERS for entry in entries if not any(places(entry, m) for m in MODULES)]
    assert not missing, f"{DOC.name} § Layers names modules kiln/ does not have: {missing}"


def test_every_import_follows_the_layer_table():
    offenders = [
        f"{path.relative_to(ROOT)}:{violation}"
        for module, path in MODULES.items()
        for violation in violations(path.read_text(), module)
    ]
    assert not offenders, f"imports that {DOC.name} § Layers forbids:\n" + "\n".join(offenders)


@pytest.mark.parametrize("source", [
    "import kiln.client",
    "import kiln.client.sync as sync",
    "from kiln.client import Client",
    "from kiln.client.text import opt_in",
    "from kiln import client",
    "from ..client import Client",
    "from .. import client",
    "def later():\n    from kiln.client import Client",
])
def test_every_form_of_importing_the_sdk_is_found(source):
    assert violations(source, "kiln.server.app")


@pytest.mark.parametrize(("importer", "source"), [
    ("kiln.kv.layout", "from kiln.models.config import ModelConfig"),
    ("kiln.models.attention", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kiln.engine.runner import Runner"),
    ("kiln.engine.scheduler", "def later():\n    from kiln import sessions"),
    ("kiln.snapshots.store", "from ..llm import LLM"),
    ("kiln.kv", "from ..engine import sequence"),  # a package's own __init__: `..` is kiln
    ("kiln.kernels.build", "import kiln.kv.codec"),
    ("kiln.kernels.build", "from kiln.tokenizer import Tokenizer"),  # below the kernels, but not kiln.errors
    ("kiln.tokenizer", "from kiln.kernels import kernels"),
    ("kiln.client.sync", "from kiln.llm import LLM"),  # the SDK imports only the foundation
    ("kiln.engine.output", "from kiln.chat import ChatFormat"),  # text formats stay out of the engine
])
def test_every_form_of_importing_a_layer_above_is_found(importer, source):
    assert violations(source, importer)


@pytest.mark.parametrize(("importer", "source"), [
    ("kiln.server.app", "import kiln.clients"),  # no such module: kiln itself, the foundation
    ("kiln.server.app", "from kiln import chat, text"),
    ("kiln.server", "from .client import Client"),  # kiln.server.client, not the SDK
    ("kiln.server.app", "example = 'from kiln.client import Client'"),
    ("kiln.cli", "from kiln.client import Client"),
    ("kiln.models.attention", "from kiln.kv.step import KVStep"),
    ("kiln.kernels", "from kiln.errors import UnavailableError\nfrom kiln.kernels import build"),
    ("kiln.client.channel", "from kiln import __version__\nfrom kiln.pem import read_pem"),
    ("kiln.sessions", "import numpy\nfrom kiln.snapshots.persistence import Persistence"),
])
def test_imports_the_table_allows_are_not_reported(importer, source):
    assert not violations(source, importer)
