"""The package's shape: mtp's modules import one another without a circle, each at its top (no import inside a
function to dodge one)."""

import ast

from tests.conftest import ROOT


def imports() -> dict[str, tuple[set[str], list[str]]]:
    """Per mtp module (dotted name): the mtp modules it imports, and those it imports inside a function."""
    found = {}
    for path in sorted((ROOT / "mtp").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text())
        inside = {id(node) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for node in ast.walk(fn)}
        top, nested = set(), []
        for node in ast.walk(tree):
            modules = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if modules == ["mtp"]:  # from mtp import module
                modules = [f"mtp.{alias.name}" for alias in node.names]
            modules += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for module in (m for m in modules if m.startswith("mtp.")):
                (nested.append(module) if id(node) in inside else top.add(module))
        found[name] = top, nested
    return found


def test_no_module_imports_itself_through_others_and_none_imports_inside_a_function():
    found = imports()
    graph = {name: {m for m in top if m in found} for name, (top, _) in found.items()}
    assert len(graph) > 20 and graph["mtp.decoding"] >= {"mtp.batch", "mtp.folder"}  # the walk sees the package

    def circle(start: str) -> list[str] | None:
        paths = [[start]]
        while paths:
            path = paths.pop()
            for module in graph[path[-1]]:
                if module == start:
                    return [*path, start]
                if module not in path:
                    paths.append([*path, module])
        return None

    assert [path for name in graph if (path := circle(name))] == []
    assert {name: nested for name, (_, nested) in found.items() if nested} == {}
