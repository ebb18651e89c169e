"""No import cycles among the project's modules, counting imports inside functions too
(a cycle hidden in a late import is still a cycle: two modules that cannot be read, or
changed, one without the other). And the architecture's rules on who imports whom: no
service imports `tools` (the checkpoint makers: `pagedserve make-model`, the tests, the
benchmarks); `encoder_svc` imports no `worker_svc` module; `modeling` and `vision` (the
model code and the vision path both share) import no service; the scheduler's policy
(`scheduler_svc/policy/`) imports no `redis`, `grpc` or `asyncio`, nor a scheduler service module."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="module")
def project_graph() -> tuple[dict[str, Path], dict[str, set[str]]]:
    """The project's modules and the project modules each imports, read once for every rule."""
    modules = project_modules()
    return modules, {name: imported(name, path, modules) for name, path in modules.items()}


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


def test_no_import_cycles(project_graph):
    modules, graph = project_graph
    assert {"compose.cli", "compose.commands", "compose.launcher", "gateway.config"} <= set(modules)
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


def test_no_service_imports_tools(project_graph):
    """The checkpoint makers serve `pagedserve make-model`, the tests and the benchmarks; a
    running service needs none of them (nor their torch-at-import presets)."""
    modules, graph = project_graph
    assert {"tools", "tools.make_model", "tools.model_presets"} <= set(modules)
    assert "tools.model_presets" in graph["tools.make_model"]  # imports are seen
    assert forbidden_imports(graph, SERVICES, ("tools",)) == []


SHARED = ("modeling", "vision")  # the model code and the vision path, the worker's and the encoder's


def test_the_rule_checker_sees_the_encoder_importing_the_worker(tmp_path):
    late = tmp_path / "late.py"
    late.write_text("def run():\n    from worker_svc import server\n")
    modules = {"encoder_svc.late": late, "worker_svc": late, "worker_svc.server": late,
               "vision.media_encoder": late, "modeling.registry": late}
    graph = {"encoder_svc.late": imported("encoder_svc.late", late, modules),
             "encoder_svc.service": {"vision.media_encoder", "modeling.registry"},
             "vision.media_encoder": {"modeling.registry", "worker_svc.server"}}
    assert forbidden_imports(graph, ("encoder_svc",), ("worker_svc",)) == [
        ("encoder_svc.late", "worker_svc"), ("encoder_svc.late", "worker_svc.server")]
    assert forbidden_imports(graph, SHARED, SERVICES) == [("vision.media_encoder", "worker_svc.server")]


def test_the_encoder_service_imports_no_worker_module(project_graph):
    """The encoder service encodes by the worker's own path without loading the worker: what
    both run is in `vision` (media to embeddings, published) and `modeling` (the model code)."""
    modules, graph = project_graph
    assert {"encoder_svc.service", "vision.media_encoder", "modeling.registry"} <= set(modules)
    assert "vision.media_encoder" in graph["encoder_svc.service"]  # imports are seen
    assert forbidden_imports(graph, ("encoder_svc",), ("worker_svc",)) == []


def test_the_shared_packages_import_no_service(project_graph):
    """`modeling` and `vision` serve the worker and the encoder service alike (and the tests and
    the benchmarks): neither imports a service, so neither drags one in with it."""
    modules, graph = project_graph
    assert {"modeling.decoder", "modeling.gemma3_vision", "vision.media_encoder"} <= set(modules)
    assert "modeling.gemma3_vision" in graph["vision.media_encoder"]  # imports are seen
    assert forbidden_imports(graph, SHARED, SERVICES) == []


def imported_names(path: Path) -> set[str]:
    """The top-level name of every absolute import in `path`, anywhere in its body (inside
    functions too): `import redis.asyncio as aioredis` and `from redis.exceptions import
    RedisError` both give `redis`. Third-party, stdlib and project names alike; a relative
    import is the project's own (`imported` sees it)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.partition(".")[0])
    return names


POLICY = ("scheduler_svc.policy",)
NOT_IN_POLICY = ("redis", "grpc", "asyncio")  # Redis, gRPC and the event loop are the service's


def scheduler_service(modules: dict[str, Path]) -> tuple[str, ...]:
    """The scheduler service's modules: scheduler_svc's, outside policy/ (the package's
    `__init__`, a docstring, is neither)."""
    return tuple(sorted(name for name in modules
                        if name.startswith("scheduler_svc.") and not in_package(name, POLICY)))


def test_the_rule_checker_sees_the_policy_importing_io_or_the_service(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import math\nimport redis.asyncio as aioredis\n\ndef run():\n    from grpc import aio\n"
                       "    from scheduler_svc import shard\n    from scheduler_svc.policy import queues\n"
                       "    from . import request\n")
    assert imported_names(planted) == {"math", "redis", "grpc", "scheduler_svc"}
    modules = {"scheduler_svc.policy.planted": planted, "scheduler_svc": planted, "scheduler_svc.shard": planted,
               "scheduler_svc.policy": planted, "scheduler_svc.policy.queues": planted,
               "scheduler_svc.policy.request": planted}
    names = {"scheduler_svc.policy.planted": imported_names(planted),
             "scheduler_svc.shard": {"asyncio", "redis"}}  # the service may
    assert forbidden_imports(names, POLICY, NOT_IN_POLICY) == [
        ("scheduler_svc.policy.planted", "grpc"), ("scheduler_svc.policy.planted", "redis")]
    graph = {"scheduler_svc.policy.planted": imported("scheduler_svc.policy.planted", planted, modules)}
    assert scheduler_service(modules) == ("scheduler_svc.shard",)
    assert forbidden_imports(graph, POLICY, scheduler_service(modules)) == [
        ("scheduler_svc.policy.planted", "scheduler_svc.shard")]


def test_the_scheduler_policy_imports_no_io_and_no_service(project_graph):
    """The scheduler's policy -- BatchScheduler and its parts, routing -- is pure: no Redis, no
    gRPC, no event loop, no service module; it runs, and is tested, on its own
    (docs/architecture.md). The service modules beside it are its shell."""
    modules, graph = project_graph
    assert {"scheduler_svc.policy.batching", "scheduler_svc.policy.routing", "scheduler_svc.shard"} <= set(modules)
    names = {name: imported_names(path) for name, path in modules.items()}
    assert {"redis", "asyncio"} <= names["scheduler_svc.shard"]  # imports are seen
    assert "scheduler_svc.policy.batching" in graph["scheduler_svc.worker_pool"]
    assert "scheduler_svc.shard" in scheduler_service(modules)
    assert forbidden_imports(names, POLICY, NOT_IN_POLICY) == []
    assert forbidden_imports(graph, POLICY, scheduler_service(modules)) == []
