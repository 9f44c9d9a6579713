"""The package's import graph (engine/, parallel/, algorithms/) has no cycles.

Built from the source with `ast`, no imports run. Every import counts, also those inside functions (a lazy
import that closes a cycle hides a layering problem, it does not remove it), except those under
`if TYPE_CHECKING:`, which never run.
"""

from __future__ import annotations

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("engine", "parallel", "algorithms")


def _modules() -> dict[str, str]:
    """{dotted module name: file path} of every module in PACKAGES."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[: -len(".py")]
                    name = rel.replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = os.path.join(dirpath, f)
    return out


def matching_lines(packages: tuple[str, ...], pattern: re.Pattern) -> list[str]:
    """`path:line: text` of every source line of `packages` that `pattern` finds."""
    found = []
    for pkg in packages:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    with open(path, encoding="utf-8") as fh:
                        for i, line in enumerate(fh, 1):
                            if pattern.search(line):
                                found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    return found


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, name: str, is_pkg: bool, modules: dict[str, str]) -> set[str]:
    """The package modules that the module `name` imports."""
    out: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*parts, base] if base else parts)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
        stack.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        graph[name] = _imports(tree, name, path.endswith("__init__.py"), modules)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among the package's modules:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_engine_asks_registries_instead_of_branching_on_algorithm_names():
    """Outside algorithms/, no `== "<algorithm name>"` / `!= "<algorithm name>"`: the engine asks the traits
    an algorithm was registered with (algorithms/advantages.py, algorithms/losses.py)."""
    names = r"gae|grpo|remax|gspo|rloo|opo|reinforce_pp|reinforce_pp_baseline|ppo|adaptive|fixed"
    branch = re.compile(rf"""[=!]=\s*["']({names})["']|\bin\s*\(\s*["']({names})["']""")
    found = matching_lines(("engine", "parallel"), branch)
    assert not found, "branches on algorithm names:\n" + "\n".join(found)


def test_trainer_only_sequences():
    """engine/trainer.py sequences the phases of engine/step/: short, and no collective of its own."""
    with open(os.path.join(ROOT, "engine", "trainer.py"), encoding="utf-8") as f:
        source = f.read()
    assert len(source.splitlines()) <= 250
    assert "torch.distributed" not in source and "dist." not in source


def test_sources_link_nothing_outside_the_repository():
    """Docstrings and comments of the package point at files of the repository only."""
    found = matching_lines(PACKAGES, re.compile(r"(\.\./)?shared/(notes|device)/"))
    assert not found, "links outside the repository:\n" + "\n".join(found)


def test_validation_does_not_import_megatron():
    """engine/validate/ checks the config (and reads config.json files) before the megatron stack loads."""
    import subprocess
    import sys

    code = "import sys, engine.validate; print(any(m.startswith('megatron') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
