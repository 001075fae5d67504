"""The package map of docs/design.md, checked against the code: which package may import which.

Imports are read from the source (every `import` and `from ... import`, inside functions
too, since a deferred import still runs), leaving out those under `if TYPE_CHECKING:`,
which never run. No model is loaded: these are specifications of the layout.

The flow runs one way: `cli / tui -> chat -> model -> cache -> compress`, with `recall`
beside the cache, `storage` beside the chat service, and a few leaf modules everyone may use.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvchat"
# Lines of code per module, not counting docstrings, comments and blank lines.
MAX_CODE_LINES = 600

# Leaves: modules of plain facts and types that import no other part of kvchat (settings
# checks a method name against the compressor registry, and reads paths and errors).
LEAVES = {"errors", "turns", "kv_types", "runtime", "paths", "optional", "settings"}
LEAF_RULES = {
    "errors": set(),
    "turns": set(),
    "kv_types": set(),
    "runtime": set(),
    "paths": {"errors"},
    "optional": {"errors"},
    "settings": {"errors", "paths", "compress"},
}
# Who may import whom, by package. A package may always import itself and the leaves
# (except where LEAF_RULES says otherwise for a leaf).
PACKAGE_RULES = {
    "native": set(),
    "compress": {"native"},
    "recall": {"native"},
    "cache": {"compress", "recall", "native"},
    "calibration": {"cache", "compress"},
    "model": {"cache", "recall", "compress", "calibration", "native"},
    "storage": set(),
    "documents": set(),
    "chat": {"model", "storage", "compress"},
    "bench": {"chat", "model", "storage", "calibration", "cache", "recall", "compress", "native"},
    "tui": {"chat", "documents"},
    "cli": {"tui", "chat", "documents", "bench", "model", "storage", "calibration", "compress", "native"},
}
# Scripts run with `python -m`, above every package.
ENTRY_POINTS = {"kvchat.__main__", "kvchat.calibration.measured.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def part_of(name: str) -> str:
    """The package (or leaf module) a module belongs to: `kvchat.cache.layer` -> `cache`."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "kvchat"


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


def code_lines(source: str) -> int:
    """Lines of code: docstrings, comments and blank lines left out."""
    tree = ast.parse(source)
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def test_the_import_reader_sees_deferred_imports_and_skips_type_checking_ones():
    # The controller imports the chat's persistence only inside its methods, and the
    # store only for annotations.
    assert "kvchat.chat.persist" in imports_of("kvchat.chat.controller")
    assert "kvchat.storage.db" not in imports_of("kvchat.chat.controller")


def test_the_code_line_counter_leaves_out_docstrings_comments_and_blank_lines():
    source = 'def f():\n    """Doc\n    string."""\n\n    # a comment\n    return 1\n'
    assert code_lines(source) == 2


def test_every_module_belongs_to_a_package_or_is_a_leaf():
    allowed = set(PACKAGE_RULES) | LEAVES | {"kvchat", "__main__"}
    strays = sorted(name for name in MODULES if part_of(name) not in allowed)
    assert strays == [], f"modules outside the map: {strays}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n not in ENTRY_POINTS))
def test_a_module_imports_only_what_its_package_may(name):
    own = part_of(name)
    if own in LEAF_RULES:
        allowed = LEAF_RULES[own]
    elif own == "kvchat":  # the package's __init__: the version string only
        allowed = set()
    else:
        allowed = PACKAGE_RULES[own] | LEAVES | {own}
    outside = {m for m in imports_of(name) if part_of(m) not in allowed | {own, "kvchat"}}
    assert outside == set(), f"{name} ({own}) may not import {sorted(outside)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_imports_anything_that_imports_it_back(name):
    # Packages import their own modules by design (a registry, say); across modules
    # and packages there must be no cycle.
    back = {m for m in imports_of(name) if name in reachable(m) and not (is_package(m) and name.startswith(m + "."))}
    assert back == set(), f"{name} imports {sorted(back)}, which import it back"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_has_more_code_lines_than_the_limit(name):
    lines = code_lines(MODULES[name].read_text(encoding="utf-8"))
    assert lines <= MAX_CODE_LINES, f"{name} has {lines} lines of code; split it along a seam"


def test_the_app_reaches_the_model_only_through_the_chat_service():
    # (It reads the files a user attaches itself: the readers are no part of the model.)
    for name in (m for m in MODULES if part_of(m) == "tui"):
        outside = {m for m in imports_of(name) if part_of(m) not in {"tui", "chat", "documents"} | LEAVES}
        assert outside == set(), f"{name} imports {sorted(outside)}"


def test_the_app_module_loads_no_torch_before_its_first_frame():
    # The chat service's controller imports the engine, the store and the compressors only
    # inside its methods: everything the first frame needs comes before the model.
    tree = ast.parse(MODULES["kvchat.chat.controller"].read_text(encoding="utf-8"))
    top = {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert {m for m in top if m and m.startswith("kvchat")} <= {"kvchat.errors", "kvchat.settings", "kvchat.turns"}


def test_compressors_see_tensors_only():
    for name in (m for m in MODULES if part_of(m) == "compress"):
        outside = {m for m in imports_of(name) if part_of(m) != "compress"}
        assert outside <= {"kvchat.kv_types", "kvchat.runtime", "kvchat.native"}, f"{name} imports {sorted(outside)}"


def test_the_cache_never_reaches_the_model_or_the_store():
    # Per-model measurements are the engine's: it hands the cache numbers. Where files go
    # is the engine's and the store's business too.
    for name in (m for m in MODULES if part_of(m) in {"cache", "recall", "compress"}):
        hit = {m for m in reachable(name) if part_of(m) in {"model", "calibration", "storage", "chat"}}
        assert hit == set(), f"{name} reaches {sorted(hit)}"
        assert "kvchat.paths" not in imports_of(name)


def test_the_document_readers_see_files_not_the_model():
    # The app reads a file on its UI side, so the readers must never bring in torch.
    for name in (m for m in MODULES if part_of(m) == "documents"):
        hit = {m for m in reachable(name) if part_of(m) not in {"documents"} | LEAVES}
        assert hit == set(), f"{name} reaches {sorted(hit)}"


def test_the_store_sees_records_not_classes():
    for name in (m for m in MODULES if part_of(m) == "storage"):
        hit = {m for m in reachable(name) if part_of(m) in {"model", "cache", "recall", "compress", "chat"}}
        assert hit == set(), f"{name} reaches {sorted(hit)}"


# -- the map in the docs -------------------------------------------------------------------
DOCS = {page: (ROOT / page).read_text(encoding="utf-8") for page in ("docs/design.md", "README.md")}
NAMED_FILE = r"[\w/<>]+\.py"


def test_the_design_map_names_every_module():
    design = DOCS["docs/design.md"]
    named = set(re.findall(NAMED_FILE, design))
    # A folder the map describes as a whole (`tui/screens/`; `compress/<method>.py`).
    folders = set(re.findall(r"`([\w/]+/)`", design)) | {m.split("<")[0] for m in named if "<" in m}
    missing = []
    for path in MODULES.values():
        relative = path.relative_to(PACKAGE).as_posix()
        if (
            path.name == "__main__.py"
            or relative == "__init__.py"
            or (path.name == "__init__.py" and code_lines(path.read_text()) == 0)
        ):
            continue
        parent = relative.rpartition("/")[0] + "/"
        placed = relative in named or any(parent.endswith(f) for f in folders)
        if not placed:
            missing.append(relative)
    assert missing == [], f"docs/design.md does not place {missing}"


@pytest.mark.parametrize("page", sorted(DOCS))
def test_every_module_a_page_names_exists(page):
    files = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if ".venv" not in p.parts}
    for named in set(re.findall(NAMED_FILE, DOCS[page])):
        if "<" in named:  # a pattern such as compress/<method>.py
            continue
        found = any(f == named or f.endswith("/" + named) for f in files)
        assert found, f"{page} names {named}, which does not exist"
