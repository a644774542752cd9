"""The tree follows the import rules of docs/architecture.md ("Repository layout", the table's
last column), has no import cycles, and keeps services/ modules short.

Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layout_rules(text: str) -> dict[str, set[str]]:
    """``{package: packages it may import}`` from the "Repository layout" table of the architecture
    doc: every row whose folder is a Python package, its last column (backticked names, or "nothing
    of ours")."""
    section = text.split("## Repository layout", 1)[1].split("\n## ", 1)[0]
    rules: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `([a-z_]+)/` \|.*\| ([^|]+) \|$", section, re.M):
        folder, allowed = row
        if folder != "tests" and (ROOT / folder / "__init__.py").exists():
            rules[folder] = set(re.findall(r"`([a-z_]+)`", allowed))
    return rules


ALLOWED = layout_rules(ARCHITECTURE.read_text())
PACKAGES = tuple(ALLOWED)
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


def test_the_layout_table_names_every_package() -> None:
    """Every top-level Python package of the repository has its row (and rules) in the doc."""
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert on_disk == set(PACKAGES), f"packages without a row: {on_disk - set(PACKAGES)}; rows without a package: {set(PACKAGES) - on_disk}"
    assert all(dep in PACKAGES for deps in ALLOWED.values() for dep in deps)


def test_layout_rules_are_read_from_the_table() -> None:
    doc = ("## Repository layout\n| `schemas/` | x | nothing of ours |\n| `trainer/` | y | `schemas`, `weights` |\n"
           "| `bench/` | z | — |\n| `tests/` | t | — |\n## Next\n| `envs/` | w | `schemas` |\n")
    assert layout_rules(doc) == {"schemas": set(), "trainer": {"schemas", "weights"}}


MAX_MODULE_DOCSTRING_LINES = 40
"""The issue-34 bound: a module docstring says what the module does (about 25 lines); narrative
belongs in docs/architecture.md."""


def test_module_docstrings_are_short() -> None:
    long = {}
    for folder in (*PACKAGES, "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
            if (n := len(doc.splitlines())) > MAX_MODULE_DOCSTRING_LINES:
                long[str(path.relative_to(ROOT))] = n
    assert not long, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: {long}"


def python_lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in (ROOT / folder).rglob("*.py"))


def test_services_hold_the_handlers_alone() -> None:
    """``services/`` is the handlers: at most 30% of the library's Python (tests and bench excluded)."""
    total = sum(python_lines(pkg) for pkg in PACKAGES) + python_lines("scripts")
    share = python_lines("services") / total
    assert share <= 0.30, f"services/ is {share:.0%} of the library's Python lines"


def test_no_stubbed_methods_in_the_runtime() -> None:
    """The runtime composes its loops: no ``NotImplementedError`` stubs (abstract methods are ``abc``)."""
    stubs = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "runtime").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "raise NotImplementedError" in line]
    assert not stubs, stubs


def test_thread_calls_surface_every_error() -> None:
    """Library code awaits thread calls through ``schemas.errors.to_thread`` / ``surfaced``: with
    plain ``asyncio.to_thread`` a ``StopIteration`` raised on the thread hangs the await for ever."""
    plain = [f"{p.relative_to(ROOT)}:{i}" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "asyncio.to_thread(" in line and p != ROOT / "schemas" / "errors.py"]
    assert not plain, plain


def test_the_contract_is_in_the_repository() -> None:
    """Nothing cites a DESIGN.md outside the repository: the contract is docs/architecture.md."""
    cited = []
    for path in ROOT.rglob("*"):
        if path.suffix in (".py", ".md", ".yaml", ".toml") and not any(
                part.startswith(".") or part in ("runs", "models") for part in path.relative_to(ROOT).parts):
            if "DESIGN.md" in path.read_text(errors="replace") and path != Path(__file__):
                cited.append(str(path.relative_to(ROOT)))
    assert not cited, cited


def test_no_bench_script_shadows_a_package() -> None:
    """A bench script runs with bench/ first on sys.path (and hands that path to the services it
    starts), so ``bench/weights.py`` once hid the ``weights`` package from a whole run."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert packages, "no packages found at the repository root"
    assert not scripts & packages, f"bench scripts named like packages: {sorted(scripts & packages)}"
