"""No import cycles among the project's modules, counting imports inside functions too
(a cycle hidden in a late import is still a cycle: two modules that cannot be read, or
changed, one without the other). And the architecture's rules on who imports whom: no
service imports `tools` (the checkpoint makers: `pagedserve make-model`, the tests, the
benchmarks)."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def project_modules() -> dict[str, Path]:
    """Every module of the packages pyproject.toml ships, by dotted name."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    modules = {}
    for package in packages:
        for path in (ROOT / package.replace(".", "/")).glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its body."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, maybe
    found = set()
    for target in targets:
        while target and target not in modules:  # `a.b.Thing` → module `a.b`
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


SERVICES = ("gateway", "scheduler_svc", "worker_svc", "encoder_svc")


def in_package(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def forbidden_imports(graph: dict[str, set[str]], importers: tuple[str, ...],
                      forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    """(importer, imported) for every module of `importers` that imports one of `forbidden`."""
    return sorted((name, target) for name, targets in graph.items() if in_package(name, importers)
                  for target in targets if in_package(target, forbidden))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle_through_a_late_import(tmp_path):
    late = tmp_path / "late.py"
    late.write_text("import os\n\ndef run():\n    from compose.cli import main\n    from . import flags\n")
    assert imported("compose.late", late, {"compose.cli": late, "compose.flags": late}) == {
        "compose.cli", "compose.flags"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    modules = project_modules()
    assert {"compose.cli", "compose.commands", "compose.launcher", "gateway.config"} <= set(modules)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "compose.launcher" in graph["compose.commands"]  # imports are seen
    assert cycles(graph) == []


def test_the_rule_checker_sees_a_service_importing_tools(tmp_path):
    late = tmp_path / "late.py"
    late.write_text("def run():\n    from tools.model_presets import PRESETS\n")
    modules = {"worker_svc.late": late, "tools": late, "tools.model_presets": late, "gateway.tools": late}
    graph = {"worker_svc.late": imported("worker_svc.late", late, modules),
             "gateway.app": {"gateway.tools"},  # the gateway's own tools.py is not the package
             "compose.commands": {"tools.make_model"}}
    assert forbidden_imports(graph, SERVICES, ("tools",)) == [("worker_svc.late", "tools.model_presets")]


def test_no_service_imports_tools():
    """The checkpoint makers serve `pagedserve make-model`, the tests and the benchmarks; a
    running service needs none of them (nor their torch-at-import presets)."""
    modules = project_modules()
    assert {"tools", "tools.make_model", "tools.model_presets"} <= set(modules)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "tools.model_presets" in graph["tools.make_model"]  # imports are seen
    assert forbidden_imports(graph, SERVICES, ("tools",)) == []
