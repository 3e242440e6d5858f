"""The core never imports the SDK: kiln.client may import the core's records and helpers, not the other
way round. The one exception is the CLI, itself a client (`kiln chat --server`).

Checked on the source with `ast`, so every form counts (`import kiln.client`, `from kiln.client.x import
y`, `from kiln import client`, relative imports, imports inside functions) and text in strings does not.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SDK = "kiln.client"
CLIENTS = {"kiln.cli"}  # core modules that are clients themselves


def package_of(path: Path) -> str:
    """The package that relative imports in `path` resolve against."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1])


def imported_modules(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Every module an import statement may load, relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*parent, base] if base else parent)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]  # `from kiln import client`


def is_sdk(module: str) -> bool:
    return module == SDK or module.startswith(SDK + ".")


def sdk_imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, statement) of each import of kiln.client in a module of `package`."""
    return [
        (node.lineno, ast.get_source_segment(source, node))
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom) and any(map(is_sdk, imported_modules(node, package)))
    ]


def core_modules() -> list[Path]:
    """Every module under kiln/ except the SDK's and the CLIENTS."""
    modules = []
    for path in sorted((ROOT / "kiln").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if not is_sdk(name) and name not in CLIENTS:
            modules.append(path)
    return modules


def test_the_core_does_not_import_the_sdk():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {statement}"
        for path in core_modules()
        for line, statement in sdk_imports(path.read_text(), package_of(path))
    ]
    assert not offenders, "the core imports the SDK (kiln.client); move what it needs into the core:\n" + "\n".join(
        offenders
    )


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
    assert sdk_imports(source, "kiln.server")


@pytest.mark.parametrize("source", [
    "import kiln.clients",
    "from kiln import chat, text",
    "from .client import Client",  # kiln.server.client, not the SDK
    "example = 'from kiln.client import Client'",
])
def test_strings_and_look_alike_names_are_not_imports_of_the_sdk(source):
    assert not sdk_imports(source, "kiln.server")
