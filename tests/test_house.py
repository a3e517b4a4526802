"""The house rules, read from the package's source: imports run generate -> store <- train, no module reaches
into another's private names, and the shared helpers (store/common.py) are defined once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("generate", "store", "train")


def modules() -> list[tuple[str, ast.Module]]:
    """Every package module: its dotted name (``rollshard.store.io.writer``) and its syntax tree."""
    found = []
    for stage in STAGES:
        for path in sorted((ROOT / stage).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(("rollshard", *(parts[:-1] if parts[-1] == "__init__" else parts)))
            found.append((name, ast.parse(path.read_text(), filename=str(path))))
    return found


MODULES = modules()
NAMES = {name for name, _ in MODULES}


def imported(tree: ast.Module) -> list[tuple[int, str, list[str]]]:
    """Each import anywhere in the module (inside functions too): line, module, the names taken from it."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
    return out


def test_the_sources_were_found():
    assert {"rollshard.store.common", "rollshard.generate.run", "rollshard.train.trainer"} <= NAMES
    assert len(MODULES) > 100


def test_store_imports_neither_generate_nor_train():
    bad = [f"{name}:{line}: {module}" for name, tree in MODULES if name.startswith("rollshard.store")
           for line, module, _ in imported(tree) if module.startswith(("rollshard.generate", "rollshard.train"))]
    assert bad == []


def test_generate_and_train_do_not_import_each_other():
    bad = [f"{name}:{line}: {module}" for name, tree in MODULES for line, module, _ in imported(tree)
           if (name.startswith("rollshard.generate") and module.startswith("rollshard.train"))
           or (name.startswith("rollshard.train") and module.startswith("rollshard.generate"))]
    assert bad == []


def _is_module(dotted: str) -> bool:
    return dotted in NAMES


def private_uses(name: str, tree: ast.Module) -> list[str]:
    """A private name used outside its module: ``from rollshard.m import _x``, and ``m._x`` or ``m.Class._x`` where
    ``m`` is a rollshard module however it was bound (``import rollshard.m as m``, ``from rollshard.pkg import m``,
    or the whole path ``rollshard.m._x``)."""
    bad, aliases = [], {"rollshard": "rollshard"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rollshard") and node.level == 0:
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{name}:{node.lineno}: from {node.module} import {a.name}")
                elif _is_module(f"{node.module}.{a.name}"):
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("rollshard") and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:  # a module's name, or its class's
                bad.append(f"{name}:{node.lineno}: {'.'.join([aliases[value.id], *reversed(chain), node.attr])}")
    return bad


def test_no_module_uses_another_modules_private_names():
    bad = [b for name, tree in MODULES for b in private_uses(name, tree)]
    assert bad == []


def test_the_check_of_private_names_catches_every_form():
    tree = ast.parse("from rollshard.store.io import writer\nfrom rollshard.train.loop import _x\nwriter._y\n"
                     "import rollshard.store.io.dataset as ds\nds._z\nimport rollshard.train.loop\n"
                     "rollshard.train.loop._w\nwriter.ShardWriter._v\n")
    assert private_uses("m", tree) == [
        "m:2: from rollshard.train.loop import _x", "m:3: rollshard.store.io.writer._y",
        "m:5: rollshard.store.io.dataset._z", "m:7: rollshard.train.loop._w",
        "m:8: rollshard.store.io.writer.ShardWriter._v",
    ]


SHARED = ("one_line", "print_error", "show_number", "num", "write_atomic", "fsync_dir", "backoff_delay", "progress",
          "file_sha256", "utc_now")


@pytest.mark.parametrize("helper", SHARED)
def test_a_shared_helper_is_defined_once(helper):
    where = [name for name, tree in MODULES for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == helper]
    assert where == ([] if helper == "num" else ["rollshard.store.common"])  # num: show_number's three old copies


def test_the_errors_and_exit_statuses_are_defined_once():
    classes = [(name, node.name) for name, tree in MODULES for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name in ("UsageError", "DataError")]
    assert sorted(classes) == [("rollshard.store.common", "DataError"), ("rollshard.store.common", "UsageError")]
    # An exit status is a number only there; elsewhere a name for one of them (EXIT_FLAGGED = EXIT_FAILED).
    numbered = {name for name, tree in MODULES for node in tree.body if isinstance(node, ast.Assign)
                if any(isinstance(t, ast.Name) and t.id.startswith("EXIT_") for n in node.targets for t in ast.walk(n))
                and any(isinstance(v, ast.Constant) for v in ast.walk(node.value))}
    assert numbered == {"rollshard.store.common"}
