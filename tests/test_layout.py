"""The package's shape: mtp's modules import one another without a circle, each at its top (no import inside a
function to dodge one)."""

import ast
import re
import subprocess
import sys

import pytest

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
    assert len(graph) > 20 and graph["mtp.decoding.decoder"] >= {
        "mtp.decoding.batch",
        "mtp.decoding.proposer",
    }  # the walk sees the package

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


def test_each_layer_imports_only_the_layers_below_it_and_only_the_drafter_contract_names_kinds():
    """decoding/ imports nothing of the drafters (what it needs of one, `DrafterProtocol`, it declares), nor Lightning,
    training or tools; drafters/ neither training nor tools; training/ no tool; only the drafters themselves (and
    the drafters' package, which imports every kind so that the registry is complete whatever part of it is
    imported) import a kind."""
    found = imports()
    kinds = {"mtp.drafters.heads", "mtp.drafters.eagle", "mtp.drafters.eagle_proposer"}
    above = {
        "mtp.decoding": ("mtp.training", "mtp.tools", "mtp.drafters"),
        "mtp.drafters": ("mtp.training", "mtp.tools"),
        "mtp.training": ("mtp.tools",),
    }
    crossing = {
        (name, module)
        for name, (top, _) in found.items()
        for layer, banned in above.items()
        if name.startswith(layer + ".")
        for module in top
        if module.startswith(banned)
    }
    assert crossing == set()
    outside = {
        (name, module)
        for name, (top, _) in found.items()
        for module in top & kinds
        if not name.startswith("mtp.drafters")
    }
    assert outside == set()
    for path in (ROOT / "mtp" / "decoding").glob("*.py"):  # the verifier runs without Lightning installed
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not {name for name in names if name.split(".")[0] in ("lightning", "torchmetrics")}, path.name


@pytest.mark.slow
def test_importing_a_part_builds_only_what_it_imports_and_the_contract_alone_knows_every_kind():
    """The package root imports nothing until a name of it is used; any module of the drafters fills the registry."""
    code = (
        "import sys, mtp.training.loss; print(sorted(m for m in sys.modules if m.startswith('mtp.')))\n"
        "from mtp.drafters.contract import Drafter; print(sorted(Drafter.kinds))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    loaded, kinds = out.stdout.splitlines()
    assert loaded == str(["mtp.training", "mtp.training.loss"]) and kinds == str(["eagle", "hydra", "medusa"])


def test_no_function_or_class_name_is_defined_twice_in_the_package():
    """One name, one thing: a module-level function or class of mtp is defined once (a command's `main` aside)."""
    where = {}
    for path in sorted((ROOT / "mtp").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name != "main":
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_only_mtp_internals_touches_private_names_of_torch_and_transformers():
    """What torch, inductor and transformers do not publish moves between their releases: `mtp.internals` holds every
    reach into it, with the versions it was written for; no other module of mtp names a private module, function or
    attribute of theirs."""
    private = re.compile(r"\b(torch|transformers)(\.\w+)*\._[a-zA-Z]|\._(version|attn_implementation)\b")
    found = {
        path.relative_to(ROOT).as_posix(): [line for line in path.read_text().splitlines() if private.search(line)]
        for path in sorted((ROOT / "mtp").rglob("*.py"))
    }
    assert found.pop("mtp/internals.py") and {path: lines for path, lines in found.items() if lines} == {}


def test_every_function_in_the_package_fits_a_screen():
    """At most 80 lines and 10 parameters a function (its docstring included): a longer one is split where it does
    two things."""
    long = {}
    for path in sorted((ROOT / "mtp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                args = node.args
                named = [arg.arg for arg in args.posonlyargs + args.args + args.kwonlyargs]
                count = len(named) - (named[:1] in (["self"], ["cls"]))
                if node.end_lineno - node.lineno >= 80 or count > 10:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = (
                        node.end_lineno - node.lineno + 1,
                        count,
                    )
    assert long == {}
