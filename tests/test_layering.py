"""The layout's rules, checked on every module's imports: no import runs up a layer, no cycle.

The layers (README "Layout") from the ground floor up; a module may import its own group and
the groups listed for it, nothing else of the project:

- ``protocol``: key names, models, exceptions, the job store, the scheduler contract.
- ``schedulers.planning``: the offline tool chain (profile CSV, DAG, planner, plan files).
- ``schedulers``: the schedulers rq workers run.
- ``worker_client``: the training-loop callback interface both optimizers subclass.
- ``worker_client.gpu``: NVML facades, frequency controller, energy measurement.
- ``worker_client.hook``: the training hook and its Redis session.
- ``worker_client.power_limit``: the power-limit optimizer.
- ``worker_client.integrations``: adapters for third-party pipeline engines.
- ``worker_client.simulated``: the simulated GPU and simulated pipeline training (which trains
  through the integrations as a user's script would).
- ``coordinator``: the stream consumer, rq tasks, worker loop, status, embedded Redis.
- top floor: ``coordinator.cli``, ``coordinator.cli_demo``, ``coordinator.cli_job_data`` and
  ``coordinator.demo`` (the ``perseus`` command group, its commands that send as a rank does,
  and the demo), which may import anything below.

Imports inside functions count too. Each one must name a heavy optional dependency it avoids
(torch, matplotlib, lowtime) in a comment on its line or in the block of imports it opens.

Pydantic models (and pydantic dataclasses) are defined in ``protocol.models`` only, the one
models module the hook and the services share; the CLI's settings are the one exception.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pydantic
import pytest
from pydantic.dataclasses import is_pydantic_dataclass

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "schedulers", "worker_client", "coordinator")
TOP_FLOOR = {
    "coordinator.cli",
    "coordinator.cli_demo",
    "coordinator.cli_job_data",
    "coordinator.demo",
}

# Group -> the groups it may import (besides itself).
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "schedulers.planning": {"protocol"},
    "schedulers": {"protocol", "schedulers.planning"},
    "worker_client.gpu": {"protocol"},
    "worker_client.hook": {"protocol", "worker_client", "worker_client.gpu"},
    "worker_client.power_limit": {"protocol", "worker_client", "worker_client.gpu"},
    "worker_client.simulated": {
        "protocol",
        "schedulers.planning",
        "worker_client.gpu",
        "worker_client.hook",
        "worker_client.integrations",
    },
    "worker_client.integrations": {
        "protocol",
        "worker_client.gpu",
        "worker_client.hook",
    },
    "coordinator": {"protocol", "schedulers", "schedulers.planning"},
    "worker_client": set(),  # the package's __init__ and the callback interface
    "top": {
        "protocol",
        "schedulers",
        "schedulers.planning",
        "worker_client",
        "worker_client.gpu",
        "worker_client.hook",
        "worker_client.power_limit",
        "worker_client.simulated",
        "worker_client.integrations",
        "coordinator",
    },
}
HEAVY = ("torch", "matplotlib", "lowtime")


def group_of(module: str) -> str:
    """The layer group a project module belongs to."""
    if module in TOP_FLOOR:
        return "top"
    parts = module.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in ALLOWED:
        return ".".join(parts[:2])
    return parts[0]


def project_modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports_of(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported project module, line, inside a function)`` for each import in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            else:
                names = []
            for name in names:
                if name.split(".")[0] in PACKAGES:
                    found.append((name, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return found


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported name refers to (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for name, _line, _inner in imports_of(module, path):
            target = resolve(name, modules)
            if target and target != module and not modules[target].name == "__init__.py":
                graph[module].add(target)
    return graph


def test_every_module_belongs_to_a_known_layer():
    unknown = {m for m in project_modules() if group_of(m) not in ALLOWED}
    assert not unknown, f"modules outside any layer (add them to ALLOWED): {sorted(unknown)}"


def test_no_import_runs_up_a_layer():
    violations = []
    for module, targets in import_graph().items():
        mine = group_of(module)
        for target in targets:
            theirs = group_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                violations.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not violations, "imports that run up a layer:\n" + "\n".join(sorted(violations))


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_inside_functions_name_the_heavy_dependency_they_avoid():
    offenders = []
    for module, path in project_modules().items():
        lines = path.read_text().splitlines()
        for _name, line, inner in imports_of(module, path):
            if not inner:
                continue
            # The import's line and the contiguous imports, comments and blanks above it.
            first = line - 1
            while first > 0 and (
                not lines[first - 1].strip()
                or lines[first - 1].lstrip().startswith(("#", "import ", "from "))
            ):
                first -= 1
            context = " ".join(lines[first:line]).lower()
            if not any(heavy in context for heavy in HEAVY):
                offenders.append(f"{path.relative_to(ROOT)}:{line}: {lines[line - 1].strip()}")
    assert not offenders, (
        "project imports inside functions without a reason (torch/matplotlib/lowtime):\n"
        + "\n".join(sorted(set(offenders)))
    )


@pytest.mark.parametrize(
    ("importer", "imported"),
    [("protocol.keys", "coordinator.service"), ("schedulers.frontier", "coordinator.tasks")],
)
def test_the_checker_sees_a_violation(importer, imported):
    # Guards the checker itself: an upward import must be reported by the rule it applies.
    assert group_of(imported) not in ALLOWED[group_of(importer)]


def _test_module_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_tests_share_helpers_not_other_test_modules():
    """Tests share conftest.py and helper modules (tests/helpers.py, ...), never a test module."""
    offenders = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        bad = sorted(n for n in _test_module_imports(path) if n.startswith("tests.test_"))
        if bad:
            offenders[path.name] = bad
    assert not offenders, f"test modules importing other test modules: {offenders}"


# The one pydantic models module, and the settings (pydantic-settings) built by the CLI.
MODEL_HOMES = {"protocol.models", "coordinator.settings"}


def pydantic_classes(module: ModuleType) -> list[str]:
    """Classes defined in ``module`` that are pydantic models, settings or pydantic dataclasses.

    Checked on the imported classes, so a subclass of another model, an aliased base and a
    ``pydantic.dataclasses.dataclass`` all count.
    """
    return sorted(
        name
        for name, obj in vars(module).items()
        if inspect.isclass(obj)
        and obj.__module__ == module.__name__
        and (issubclass(obj, pydantic.BaseModel) or is_pydantic_dataclass(obj))
    )


def test_pydantic_models_live_in_one_module():
    """The hook and the services share one models module (protocol/models.py)."""
    offenders = {
        name: found
        for name in project_modules()
        if name not in MODEL_HOMES and (found := pydantic_classes(importlib.import_module(name)))
    }
    assert not offenders, f"pydantic models outside protocol/models.py: {offenders}"


def test_the_model_check_sees_every_kind_of_model(tmp_path):
    stray = tmp_path / "stray_models.py"
    stray.write_text(
        "import pydantic\n"
        "from pydantic import BaseModel as Aliased\n"
        "from pydantic.dataclasses import dataclass\n"
        "from protocol.models import JobInfo\n"
        "class Derived(JobInfo):\n    pass\n"
        "class ViaAlias(Aliased):\n    x: int\n"
        "class Direct(pydantic.BaseModel):\n    x: int\n"
        "@dataclass\nclass PydanticDataclass:\n    x: int\n"
        "class Plain:\n    x: int\n"
    )
    spec = importlib.util.spec_from_file_location("stray_models", stray)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert pydantic_classes(module) == ["Derived", "Direct", "PydanticDataclass", "ViaAlias"]
