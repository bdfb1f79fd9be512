"""`context/` is the pure engine: it imports nothing from the shell (gateway/, channels/)
except the shared message vocabulary `gateway.types` — not even for type checking or
inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

CONTEXT_DIR = Path(__file__).resolve().parent.parent / "context"
ALLOWED = {"gateway.types"}
SHELL_PACKAGES = ("gateway", "channels")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an `import`, `from … import` or a literal `importlib.import_module(…)` /
    `__import__(…)` names, wherever it sits (top level, `if TYPE_CHECKING:`, functions)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from gateway import config` imports gateway.config: name the submodules too.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in {"import_module", "__import__"} and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def forbidden(module: str) -> bool:
    top = module.split(".")[0]
    if top not in SHELL_PACKAGES:
        return False
    return not any(module == ok or module.startswith(ok + ".") for ok in ALLOWED)


def test_context_imports_nothing_from_the_shell_but_the_message_types() -> None:
    modules = sorted(CONTEXT_DIR.rglob("*.py"))
    assert len(modules) >= 8  # the walk really sees the engine
    offending = [
        f"{path.relative_to(CONTEXT_DIR.parent)}:{line}: {name}"
        for path in modules
        for line, name in imported_modules(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        if forbidden(name)
    ]
    assert offending == []


def test_the_import_walk_sees_hidden_imports() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "from gateway.types import Message\n"
        "from gateway import types\n"
        "if TYPE_CHECKING:\n"
        "    from gateway.config import Config\n"
        "def f():\n"
        "    import channels.web\n"
        "    from gateway import tools\n"
        "    return importlib.import_module('gateway.store')\n"
    )
    names = sorted(name for _, name in imported_modules(ast.parse(source)) if forbidden(name))
    assert names == ["channels.web", "gateway.config.Config", "gateway.store", "gateway.tools"]
