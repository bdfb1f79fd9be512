"""The layering docs/architecture.md states, enforced: every module of gateway/, channels/
and context/ belongs to a unit named there (a package, or a top-level module), a unit
imports only units on lower lines of the table, and no two units import each other,
directly or around a loop. Imports are counted wherever they sit: top level, `if
TYPE_CHECKING:`, inside functions, and literal `importlib.import_module(...)` calls."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

from tests.test_context_purity import imported_modules

ROOT = Path(__file__).resolve().parent.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGES = ("gateway", "channels", "context")
LAYERS_BLOCK = re.compile(r"```text layers\n(.*?)```", re.DOTALL)


def read_layers(text: str) -> list[list[str]]:
    """The ```text layers block: one line a layer, top first; units split by spaces;
    `#` starts a comment."""
    found = LAYERS_BLOCK.search(text)
    assert found, "docs/architecture.md has no ```text layers block"
    layers = []
    for line in found.group(1).splitlines():
        units = line.split("#", 1)[0].split()
        if units:
            layers.append(units)
    return layers


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str, units: Iterable[str]) -> str | None:
    """The longest unit that is `module` or a package holding it."""
    best = None
    for unit in units:
        if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
            best = unit
    return best


def import_edges(sources: dict[str, str], units: list[str]) -> tuple[dict[tuple[str, str], str], list[str]]:
    """(importer unit, imported unit) → where the first such import is; and the modules
    that belong to no unit."""
    edges: dict[tuple[str, str], str] = {}
    homeless = []
    for module, source in sorted(sources.items()):
        own = unit_of(module, units)
        if own is None:
            if module not in PACKAGES:  # the bare top-level packages hold nothing
                homeless.append(module)
            continue
        for line, name in imported_modules(ast.parse(source)):
            if name.split(".")[0] not in PACKAGES:
                continue
            target = unit_of(name, units)
            if target is None or target == own:
                continue
            edges.setdefault((own, target), f"{module}:{line} imports {name}")
    return edges, homeless


def upward(edges: dict[tuple[str, str], str], layers: list[list[str]]) -> list[str]:
    """Imports of a unit on the same line or a higher one (lines are listed top first)."""
    rank = {unit: len(layers) - i for i, line in enumerate(layers) for unit in line}
    return sorted(where for (src, dst), where in edges.items() if rank[dst] >= rank[src])


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected groups of more than one unit (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def project_sources() -> dict[str, str]:
    return {module_name(path): path.read_text(encoding="utf-8")
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def test_every_import_follows_the_layering_of_docs_architecture() -> None:
    layers = read_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    units = [unit for line in layers for unit in line]
    assert len(units) == len(set(units)), "a unit is listed twice"
    sources = project_sources()
    assert len(sources) > 80  # the walk really sees the project
    edges, homeless = import_edges(sources, units)
    assert homeless == [], "modules in no unit of docs/architecture.md's layers"
    assert cycles(edges) == []
    assert upward(edges, layers) == []
    # Every unit listed exists: the table describes this code, not an older one.
    assert sorted(u for u in units if not any(m == u or m.startswith(u + ".") for m in sources)) == []


def test_the_check_catches_an_upward_import_and_a_cycle() -> None:
    layers = [["gateway.app"], ["gateway.turns"], ["gateway.store", "gateway.model"], ["gateway.types"]]
    units = [unit for line in layers for unit in line]
    sources = {
        "gateway.app": "from gateway.turns.agent import Agent\n",
        "gateway.turns.agent": "from gateway.store.api import StoreBackend\n",
        "gateway.store.api": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gateway.turns import live\n"
        ),
        "gateway.model.client": "def f():\n    from gateway.store import sqlite\n",
        "gateway.types": "",
        "gateway.stray": "",
    }
    edges, homeless = import_edges(sources, units)
    assert homeless == ["gateway.stray"]
    assert cycles(edges) == [["gateway.store", "gateway.turns"]]
    assert upward(edges, layers) == [
        "gateway.model.client:2 imports gateway.store.sqlite",  # same line of the table
        "gateway.store.api:3 imports gateway.turns.live",  # a type-only import counts too
    ]


DATABASE_DRIVERS = ("sqlite3", "aiosqlite", "asyncpg")


def driver_imports(sources: dict[str, str]) -> list[str]:
    """Imports of a database driver outside gateway/store/: the store raises the StoreError
    family (gateway/store/errors.py), so nobody else needs a driver's exceptions."""
    return sorted(f"{module}:{line} imports {name}" for module, source in sources.items()
                  if not (module == "gateway.store" or module.startswith("gateway.store."))
                  for line, name in imported_modules(ast.parse(source))
                  if name.split(".")[0] in DATABASE_DRIVERS)


def test_only_the_store_imports_a_database_driver() -> None:
    assert driver_imports(project_sources()) == []
    assert driver_imports({"gateway.turns.router": "import sqlite3\n", "gateway.store.sqlite": "import aiosqlite\n",
                           "gateway.cluster.leases": "def f():\n    from asyncpg import PostgresError\n"}) == [
        "gateway.cluster.leases:2 imports asyncpg.PostgresError", "gateway.turns.router:1 imports sqlite3"]
