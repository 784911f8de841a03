"""Imports flow one way (STYLE.md): entry points -> config -> training -> {parallel, models,
data, export, profiling}. Checked on the source, so a new import against the flow fails here."""

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PACKAGE = os.path.join(REPO, "tf_multigpu")

# subpackage -> subpackages it must not import (a function's lazy import counts too)
FORBIDDEN = {
    "training": {"planner"},   # --strategy=auto is resolved by the entry point
    "models": {"parallel", "training", "planner", "config"},
    "data": {"parallel", "training", "planner", "config"},
    "parallel": {"training", "planner", "config", "cli"},   # cli reads the flags
    "config": {"training", "data", "models", "export", "profiling"},
}


def imported_subpackages(subpackage: str) -> dict:
    """{tf_multigpu subpackage imported: [files that import it]} for the files of `subpackage`."""
    found = {}
    folder = os.path.join(PACKAGE, subpackage)
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(folder, name)).read())
        for node in ast.walk(tree):
            for module in _absolute_names(node, f"tf_multigpu.{subpackage}"):
                parts = module.split(".")
                if parts[0] == "tf_multigpu" and len(parts) > 1:
                    found.setdefault(parts[1], []).append(f"{subpackage}/{name}")
    return found


def _absolute_names(node, package: str) -> list:
    """The dotted names an import statement brings in, relative ones resolved against
    `package`; `from a import b` gives a.b, since b may be a module (`from tf_multigpu
    import planner`) and otherwise names something inside a, which a.b still locates."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
    module = ".".join(base + (node.module.split(".") if node.module else []))
    return [f"{module}.{a.name}" for a in node.names]


def test_the_import_check_sees_every_form_of_import():
    forms = {"import tf_multigpu.training.loop": "tf_multigpu.training.loop",
             "from tf_multigpu import training": "tf_multigpu.training",
             "from tf_multigpu.training import loop": "tf_multigpu.training.loop",
             "from ..training import loop": "tf_multigpu.training.loop",
             "from .. import training": "tf_multigpu.training",
             "from .memory import x": "tf_multigpu.parallel.memory.x"}
    for code, name in forms.items():
        assert _absolute_names(ast.parse(code).body[0], "tf_multigpu.parallel") == [name], code


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_flow_one_way(subpackage):
    imported = imported_subpackages(subpackage)
    against = {target: files for target, files in imported.items() if target in FORBIDDEN[subpackage]}
    assert not against, f"{subpackage}/ imports {against}"


def test_the_config_and_the_mesh_parser_do_not_start_tensorflow():
    """The entry point builds and validates the config (a --profile name included) before it
    starts TensorFlow quietly (cli.py)."""
    code = ("import sys, tf_multigpu.parallel.mesh_spec\n"
            "from tf_multigpu.config import Config\n"
            "Config(run_dir='r', strategy='auto', mesh='', profile='yadan2013').validate()\n"
            "print('tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr[-2000:]
