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
    "parallel": {"training", "planner", "config"},
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
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for module in modules:
                parts = module.split(".")
                if parts[0] == "tf_multigpu" and len(parts) > 1:
                    found.setdefault(parts[1], []).append(f"{subpackage}/{name}")
    return found


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
