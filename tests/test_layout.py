"""The package's shape: no import cycles, and the README/DESIGN module tables name the modules that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_kit"
PLUMBING = {"__init__", "__main__", "errors"}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module → the grpo_kit modules it imports anywhere in its code (module level or inside functions)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_kit"):
                deps.add(node.module)
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name.startswith("grpo_kit"))
        graph[name] = {d for d in deps if d in modules and d != name and d != "grpo_kit"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_grpo_kit_has_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_the_core_never_needs_the_notebook_or_teaching_helpers():
    graph = import_graph()
    core = [m for m in graph if m.count(".") == 1 and m.split(".")[1] not in PLUMBING]
    for module in core:
        assert not graph[module] & {"grpo_kit.machinery.notebook", "grpo_kit.machinery.teaching"}, module


def test_readme_and_design_name_every_module():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    design = (REPO / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    core_rows = set(re.findall(r"^\| `grpo_kit\.(\w+)` \|", readme, flags=re.M))
    core = {p.stem for p in PACKAGE.glob("*.py")} - PLUMBING
    assert core_rows == core
    machinery = {p.stem for p in (PACKAGE / "machinery").glob("*.py")} - PLUMBING
    for name in machinery:
        assert f"`{name}`" in readme, f"README does not name grpo_kit/machinery/{name}.py"
        assert f"`{name}`" in design, f"docs/DESIGN.md does not name grpo_kit/machinery/{name}.py"


def test_the_core_a_learner_reads_stays_under_2500_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in PACKAGE.glob("*.py")}
    assert sum(sizes.values()) < 2500, f"grpo_kit/*.py is {sum(sizes.values())} lines ({sizes}): move machinery aside"
