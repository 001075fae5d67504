"""The map in docs/design.md, checked against the code: which module may import which.

Imports are read from the source (every `import` and `from ... import`, inside functions
too, since a deferred import still runs), leaving out those under `if TYPE_CHECKING:`,
which never run. No model is loaded: these are specifications of the layout.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvchat"
MAX_LINES = 700


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _run_time_imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _type_checking_only(node):
            yield from (n for child in node.orelse for n in _run_time_imports(ast.Module([child], [])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _run_time_imports(node)


@cache
def imports_of(name: str) -> frozenset[str]:
    """The kvchat modules `name` imports at run time."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    package = name if is_package(name) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _run_time_imports(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in MODULES)
            continue
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        for alias in node.names:
            submodule = f"{source}.{alias.name}"
            if submodule in MODULES:
                found.add(submodule)
            elif source in MODULES:
                found.add(source)
    found.discard(name)
    return frozenset(found)


def reachable(start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in imports_of(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_import_reader_sees_deferred_imports_and_skips_type_checking_ones():
    # kvchat.controller imports the engine only inside its methods, and storage.db only
    # for annotations.
    assert "kvchat.storage.persist" in imports_of("kvchat.controller")
    assert "kvchat.storage.db" not in imports_of("kvchat.controller")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_anything_that_imports_it_back(name):
    # Packages import their own modules by design (a registry, say); across modules
    # and packages there must be no cycle.
    back = {m for m in imports_of(name) if name in reachable(m) and not (is_package(m) and name.startswith(m + "."))}
    assert back == set(), f"{name} imports {sorted(back)}, which import it back"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_longer_than_the_limit(name):
    lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it along a seam"


def test_settings_errors_and_turns_are_leaves():
    assert imports_of("kvchat.errors") == set()
    assert imports_of("kvchat.turns") == set()
    # settings checks a method name against the registry when it builds CacheSettings.
    assert imports_of("kvchat.settings") <= {"kvchat.errors", "kvchat.paths", "kvchat.compress"}


def test_the_app_reaches_the_model_only_through_the_controller():
    allowed = {"kvchat.controller", "kvchat.errors", "kvchat.settings", "kvchat.turns", "kvchat.memorymap"}
    for name in (m for m in MODULES if m.startswith("kvchat.tui")):
        outside = {m for m in imports_of(name) if not m.startswith("kvchat.tui")}
        assert outside <= allowed, f"{name} imports {sorted(outside - allowed)}"


def test_the_controller_loads_nothing_heavy_before_the_model():
    # Everything the first frame needs is imported before the model loads; the engine,
    # the store and the compressors (and, through them, torch) only inside methods.
    tree = ast.parse(MODULES["kvchat.controller"].read_text(encoding="utf-8"))
    top = {
        node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level
    }
    assert top <= {"errors", "settings", "turns"}


def test_compressors_see_tensors_only():
    for name in (m for m in MODULES if m.startswith("kvchat.compress.")):
        outside = {m for m in imports_of(name) if not m.startswith("kvchat.compress")}
        assert outside <= {"kvchat.threads"}, f"{name} imports {sorted(outside)}"


def test_the_cache_never_reaches_the_model_or_the_disk():
    # Per-model measurement (kvchat.calibrate) is the engine's: it hands the cache numbers.
    forbidden = ("kvchat.models", "kvchat.calibrate", "kvchat.realkv", "kvchat.engine", "kvchat.storage",
                 "kvchat.controller")
    for name in ("kvchat.cache", "kvchat.allocate", "kvchat.positions"):
        hit = {m for m in reachable(name) if m.startswith(forbidden)}
        assert hit == set(), f"{name} reaches {sorted(hit)}"
        assert "kvchat.paths" not in imports_of(name)


def test_the_database_sees_state_dicts_not_classes():
    above = ("kvchat.engine", "kvchat.cache", "kvchat.compress", "kvchat.controller")
    for name in (m for m in MODULES if m.startswith("kvchat.storage.") and m != "kvchat.storage.persist"):
        hit = {m for m in reachable(name) if m.startswith(above)}
        assert hit == set(), f"{name} reaches {sorted(hit)}"


# -- the map in the docs -------------------------------------------------------------------
DOCS = {page: (ROOT / page).read_text(encoding="utf-8") for page in ("docs/design.md", "README.md")}
NAMED_FILE = r"[\w/<>]+\.py"


def test_the_design_map_names_every_module():
    import re

    design = DOCS["docs/design.md"]
    named = set(re.findall(NAMED_FILE, design))
    # A folder the map describes as a whole (`screens/`, `bench/`; `compress/<method>.py`).
    folders = set(re.findall(r"`([\w/]+/)`", design)) | {m.split("<")[0] for m in named if "<" in m}
    missing = []
    for path in MODULES.values():
        relative = path.relative_to(PACKAGE).as_posix()
        if path.name in {"__init__.py", "__main__.py"}:
            continue
        parent = relative.rpartition("/")[0] + "/"
        placed = relative in named or path.name in named or any(parent.endswith(f) for f in folders)
        if not placed:
            missing.append(relative)
    assert missing == [], f"docs/design.md does not place {missing}"


@pytest.mark.parametrize("page", sorted(DOCS))
def test_every_module_a_page_names_exists(page):
    import re

    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    names = {Path(f).name for f in files}
    for named in set(re.findall(NAMED_FILE, DOCS[page])):
        if "<" in named:  # a pattern such as compress/<method>.py
            continue
        found = named in names or any(f.endswith("/" + named) or f == named for f in files)
        assert found, f"{page} names {named}, which does not exist"
