"""The import graph of the project's packages: compressors <- tasks <- repro, no circle
anywhere in them, and the layers kept: no package imports one above it (the durable
writer, repro.durable, which imports nothing of the project, serves all three), the
engine's config (repro.config) sits below the rest of the engine, and the kernel layer
(compressors/kernels/) imports nothing of the compressors package outside itself, so the
algorithms sit on the kernels and never the other way round. Every import counts,
module-level or inside a function, relative ones resolved against the importing module;
plugins loaded by module name (tasks.registry's families) are not imports."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "compressors"
KERNELS = f"{PACKAGE}.kernels"
PACKAGES = ("compressors", "tasks", "repro")  # each builds on the ones before it
DURABLE = "repro.durable"
CONFIG = "repro.config"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package` under `root`, by dotted name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that the module `name` (file `path`) imports: `import a.b`
    and `from a import b` name a.b when it is a module, else a; relative imports are
    resolved against `name`'s package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in known:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
    found.discard(name)
    return found


def import_graph(root: Path = ROOT, packages: str | Sequence[str] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (all of them, every package's)."""
    mods: dict[str, Path] = {}
    for package in [packages] if isinstance(packages, str) else packages:
        mods.update(modules(root, package))
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def tangles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (each module of one reaches every
    other through imports), each sorted; Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle of imports per tangle (its modules, the first repeated at the end): the
    shortest one through the tangle's first module."""
    cycles = []
    for members in tangles(graph):
        inside, start = set(members), members[0]
        came_from: dict[str, str] = {}
        frontier = [start]
        while start not in came_from:  # breadth first, back to start
            nxt_frontier = []
            for node in frontier:
                for nxt in sorted(graph[node] & inside):
                    if nxt not in came_from:
                        came_from[nxt] = node
                        nxt_frontier.append(nxt)
            frontier = nxt_frontier
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(came_from[path[-1]])
        cycles.append(path[::-1])
    return cycles


def reach(graph: dict[str, set[str]], module: str) -> set[str]:
    """Every module that `module` imports, directly or through others."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_packages_have_no_import_circle():
    graph = import_graph()
    assert {f"{KERNELS}.ops", "tasks.base", "repro.launch"} <= set(graph)
    found = [f"{len(t)} modules ({', '.join(t)}), e.g. {' -> '.join(c)}"
             for t, c in zip(tangles(graph), find_cycles(graph))]
    assert found == [], "modules importing each other in a circle: " + "; ".join(found)


def test_no_package_imports_one_above_it():
    """compressors <- tasks <- repro; the durable writer (repro.durable, the suite's one way
    to write a file whole or not at all) serves all three and imports nothing of them."""
    graph = import_graph()
    assert graph[DURABLE] == set()
    layer = {p: i for i, p in enumerate(PACKAGES)}
    upward = sorted(f"{m} -> {t}" for m in graph for t in graph[m] if t != DURABLE
                    and layer[t.split(".")[0]] > layer[m.split(".")[0]])
    assert upward == [], "imports of a package above the importer's: " + ", ".join(upward)


def test_the_config_sits_below_the_rest_of_the_engine():
    """repro.config (schema, Hydra composition, what keys a run) reaches of the engine only
    the durable writer and the emulated network's checks: launch, runner, cluster,
    checkpoints build on it, never it on them."""
    graph = import_graph()
    engine = sorted(m for m in reach(graph, CONFIG) if m.split(".")[0] == "repro")
    assert set(engine) <= {DURABLE, "repro.netem"}, f"{CONFIG} reaches {', '.join(engine)}"
    assert reach(graph, "repro.netem") <= {DURABLE}
    assert CONFIG in graph["repro.cluster"] and "repro.launch" not in graph["repro.cluster"]


def test_the_kernel_layer_imports_no_algorithm_module():
    graph = import_graph(packages=PACKAGE)
    kernel_modules = [m for m in graph if m == KERNELS or m.startswith(KERNELS + ".")]
    assert {f"{KERNELS}.ops", f"{KERNELS}.cuda", f"{KERNELS}.sidco_pipeline"} <= set(kernel_modules)
    arrows = sorted((m, t) for m in kernel_modules for t in graph[m]
                    if not (t == KERNELS or t.startswith(KERNELS + ".")))
    assert arrows == [], "kernel modules importing the package above them: " + ", ".join(
        f"{m} -> {t}" for m, t in arrows)


def test_the_algorithms_reach_the_kernels_through_the_layer():
    """Every algorithm module that uses a kernel imports compressors.kernels.*; none imports
    the bindings of one implementation (cpu, cuda) except through ops or a pipeline."""
    graph = import_graph(packages=PACKAGE)
    direct = {f"{KERNELS}.cpu", f"{KERNELS}.cpu_thc", f"{KERNELS}.cuda", f"{KERNELS}.cuda_sidco",
              f"{KERNELS}.build"}
    algorithms = [m for m in graph if not m.startswith(KERNELS)]
    assert sorted((m, t) for m in algorithms for t in graph[m] & direct) == []
    assert any(f"{KERNELS}.ops" in graph[m] for m in algorithms)


# -- the walker itself, on a throw-away package -------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_a_circle_through_relative_and_function_level_imports_is_found(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from .sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "from ..a import something\n",
        "pkg/d.py": "import pkg.sub.c\n",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.d"] == {"pkg.sub.c"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]


def test_every_circle_is_found_across_packages(tmp_path):
    """Two separate circles, one of them through two packages and a package's __init__."""
    root = _package(tmp_path, {
        "low/__init__.py": "from low.base import Thing\n",
        "low/base.py": "def f():\n    import low\n",
        "low/tool.py": "def g():\n    from high import run\n",
        "high/__init__.py": "",
        "high/run.py": "import low.tool\n",
        "high/solo.py": "import low\n",
    })
    graph = import_graph(root, ("low", "high"))
    assert find_cycles(graph) == [["high.run", "low.tool", "high.run"],
                                  ["low", "low.base", "low"]]
    assert tangles(graph) == [["high.run", "low.tool"], ["low", "low.base"]]
    assert reach(graph, "high.solo") == {"low", "low.base"}


@pytest.mark.parametrize("text", ["import os\n", "from pkg import b\n", "from .b import g\n"])
def test_no_circle_where_imports_only_go_one_way(tmp_path, text):
    root = _package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": text, "pkg/b.py": "x = 1\n"})
    assert find_cycles(import_graph(root, "pkg")) == []


PROJECT = ("compressors", "repro", "tasks")
PROGRAMS = ("scripts", "benchmarks")


def private_uses(path: Path) -> list[str]:
    """What a program outside the packages reaches that is not public API: a private name
    imported from, or read off, a project module, or an edit of sys.path."""
    tree = ast.parse(path.read_text(), filename=str(path))
    project: set[str] = set()  # local names bound to project modules
    found: list[str] = []

    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT:
                    if private(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    project.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            for alias in node.names:
                if private(f"{node.module}.{alias.name}"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                project.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (isinstance(node.value, ast.Name) and node.value.id in project
                    and private(node.attr)):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
            if (node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"line {node.lineno}: sys.path")
    return found


def test_programs_outside_the_packages_use_only_public_api():
    """scripts/ and benchmarks/ run against the installed packages (pip install -e .):
    no sys.path edit, no private name of compressors, repro or tasks."""
    programs = [p for d in PROGRAMS for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(programs) >= 10
    problems = {str(p.relative_to(ROOT)): private_uses(p) for p in programs}
    assert not {k: v for k, v in problems.items() if v}


@pytest.mark.parametrize("text", [
    "import sys\nsys.path.insert(0, '..')\n",
    "from repro.bench import _cell\n",
    "from compressors.kernels import ops as k\nk._grid(1)\n",
    "import compressors._loaded\n",
])
def test_a_private_use_is_found(tmp_path, text):
    path = tmp_path / "prog.py"
    path.write_text(text)
    assert private_uses(path)


def test_public_uses_are_not_flagged(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text("import sys\nimport repro.bench as b\nfrom compressors.kernels import ops"
                    " as _ops\nb.timed(sys.argv)\n_ops.l2_norm(1)\nx._private = 1\n")
    assert private_uses(path) == []


def test_every_data_file_of_the_package_is_installed():
    """A non-editable install carries the kernel sources and tables: every file of
    compressors/ that is not Python matches a package-data pattern of pyproject.toml."""
    import tomllib

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"][PACKAGE]
    files = [p.relative_to(ROOT / PACKAGE) for p in (ROOT / PACKAGE).rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc", ".so")
             and "__pycache__" not in p.parts]
    assert any(p.suffix == ".cpp" for p in files)
    missing = [str(p) for p in files if not any(p.match(pat) for pat in patterns)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
