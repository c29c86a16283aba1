"""No import cycles in grpo_kit: every module imports on its own, first, in a fresh interpreter, and the graph of all
its grpo_kit imports (module level and inside functions) has no cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_kit"
FILES = {
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p for p in PACKAGE.rglob("*.py")
}
MODULES = sorted(FILES)
#: Imports each module as the first grpo_kit module of the process: a module-level cycle fails with ImportError
#: ("partially initialized module") whichever module it is entered from.
IMPORT_EACH = """
import importlib, sys
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "grpo_kit" or m.startswith("grpo_kit.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError as error:
        failed.append(f"{name}: {error}")
print("\\n".join(failed))
"""


def import_graph() -> dict[str, set[str]]:
    """Module -> the grpo_kit modules it imports anywhere in its code (module level or inside functions)."""
    graph = {}
    for name, path in FILES.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("grpo_kit"):
                deps |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                deps |= {alias.name for alias in node.names if alias.name.startswith("grpo_kit")}
        graph[name] = {d for d in deps if d in MODULES and d not in (name, "grpo_kit")}
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
                return path[path.index(dep) :] + [dep]
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


def test_every_module_imports_on_its_own():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *MODULES], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == ""


def test_grpo_kit_has_no_import_cycles():
    assert find_cycle(import_graph()) is None


def test_a_command_starts_without_library_noise():
    """PEFT imports bitsandbytes, whose CPU backend warns about the optional Hub-fetched `kernels` package on CPUs
    with AVX512-BF16; a command's stderr stays empty (the kit silences that one logger)."""
    result = subprocess.run(
        [sys.executable, "-m", "grpo_kit", "presets"], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr[-2000:]
