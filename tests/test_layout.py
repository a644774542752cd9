"""The tree follows the import rules of docs/architecture.md ("Repository layout", the table's
last column), has no import cycles, and keeps services/ modules short.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "weights", "envs", "rollout", "trainer", "runtime", "infra", "store", "services", "launch",
            "replay", "cli")
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "weights": {"schemas"},
    "envs": {"schemas"},
    "rollout": {"schemas", "weights"},
    "trainer": {"schemas", "weights"},
    "runtime": {"schemas"},
    "infra": {"schemas", "runtime"},
    "store": {"schemas"},
    "services": {"schemas", "weights", "envs", "rollout", "trainer", "runtime", "store"},
    "launch": {"schemas", "weights", "envs", "rollout", "trainer", "runtime", "infra", "store", "services"},
    "replay": {"schemas", "weights", "envs", "rollout", "trainer", "runtime", "store", "services", "launch"},
    "cli": {"schemas", "weights", "envs", "rollout", "trainer", "runtime", "infra", "store", "services", "launch",
            "replay"},
}
MAX_SERVICE_MODULE_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``path`` imports (resolved to modules where the name is a module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES:
                found.add(t)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep):], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_design_import_rules() -> None:
    breaches = []
    for mod, deps in import_graph().items():
        top = mod.split(".")[0]
        for dep in sorted(deps):
            dep_top = dep.split(".")[0]
            if dep_top != top and dep_top not in ALLOWED[top]:
                breaches.append(f"{mod} imports {dep} ({top} may import only {sorted(ALLOWED[top]) or 'nothing'})")
    assert not breaches, "\n".join(breaches)


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_services_modules_are_short() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "services").rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_SERVICE_MODULE_LINES
    }
    assert not long, f"modules over {MAX_SERVICE_MODULE_LINES} lines: {long}"


# --------------------------------------------------------------------------- the checker itself


def test_checker_finds_a_cycle_and_a_breach(tmp_path: Path) -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    modules = {"trainer.x": tmp_path / "x.py", "rollout.engine": tmp_path / "e.py", "rollout": tmp_path / "r.py"}
    src = tmp_path / "x.py"
    src.write_text("import os\ndef f():\n    from rollout.engine import Engine\n    import schemas.config\n")
    assert imports_of(src, "trainer.x", modules) == {"rollout.engine"}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_package_is_seen(pkg: str) -> None:
    assert any(m == pkg or m.startswith(pkg + ".") for m in all_modules())
