"""The package's shape, checked from its source: no import cycles between modules, and no module
reaching into another package's private names. Read with ``ast``; nothing is imported.

Every ``import`` counts, also those inside functions (deferred imports still tie modules together).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "deploykit"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE_ROOT.rglob("*.py"))}


def package_of(module: str, known: dict) -> str:
    """A package is its own package; a module belongs to the package that holds it."""
    is_package = any(other.startswith(module + ".") for other in known)
    return module if is_package else module.rpartition(".")[0]


def imported(tree: ast.Module, known: dict) -> dict[str, list[tuple[str, int]]]:
    """deploykit modules this module imports -> [(name taken from it, line)]; a name that is itself a
    module (``from deploykit.native import build``) is an import of that module."""
    found: dict[str, list[tuple[str, int]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    found.setdefault(alias.name, []).append(("", node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:
                    found.setdefault(submodule, []).append(("", node.lineno))
                else:
                    found.setdefault(node.module, []).append((alias.name, node.lineno))
    return found


def module_aliases(tree: ast.Module, known: dict) -> dict[str, str]:
    """Local names bound to deploykit modules: ``from deploykit.native import build as native``."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known and alias.asname:
                    aliases[alias.asname] = alias.name
    return aliases


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and modules importing themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_import_cycles_detector_finds_a_cycle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    known = modules()
    graph = {name: set(imported(tree, known)) - {name} for name, tree in known.items()}
    assert import_cycles(graph) == []


def private_reaches(known: dict[str, ast.Module]) -> list[str]:
    """Each place where a module uses a ``_private`` name of a module in another package."""
    reaches = []
    for name, tree in known.items():
        home = package_of(name, known)
        for target, names in imported(tree, known).items():
            if package_of(target, known) != home:
                reaches += [f"{name}:{line} imports {target}.{taken}" for taken, line in names if taken.startswith("_")]
        aliases = module_aliases(tree, known)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and node.value.id in aliases
                    and package_of(aliases[node.value.id], known) != home):
                reaches.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    return reaches


def test_private_reach_detector():
    source = {
        "dk.a.x": "def _hidden(): pass\ndef shown(): pass",
        "dk.a.y": "from dk.a.x import _hidden",  # same package: allowed
        "dk.b.z": "from dk.a.x import _hidden, shown\nfrom dk.a import x as xm\nxm._hidden(); xm.shown()",
        "dk.a": "", "dk.b": "", "dk": "",
    }
    known = {name: ast.parse(text) for name, text in source.items()}
    assert private_reaches(known) == ["dk.b.z:1 imports dk.a.x._hidden", "dk.b.z:3 uses dk.a.x._hidden"]


def test_no_private_names_across_packages():
    assert private_reaches(modules()) == []


def calls_of(method: str, known: dict[str, ast.Module]) -> list[str]:
    """Each place (module:line) that calls ``something.METHOD(...)``."""
    return [f"{name}:{node.lineno}" for name, tree in known.items() for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method]


def test_native_code_is_registered_in_one_place():
    """Only the ONNX Runtime loader registers an op library in a session, so every check (the trust
    decision's result, the ONNX Runtime version) happens on the one path native code takes."""
    places = calls_of("register_custom_ops_library", modules())
    assert [place.partition(":")[0] for place in places] == ["deploykit.backends.onnxruntime.loader"], places
