"""Every flagfile in flags/ opens with the command that runs it, and the paper's five
configurations build on 4 logical CPU devices (AlexNet, global batch 256, the paper's SGD)."""

import glob
import json
import os

import pytest

from tests.conftest import REPO, run_cli

PAPER = {   # flagfile -> (strategy, devices used, mesh)
    "paper_1gpu": ("single", 1, None),
    "paper_2gpu_data": ("data", 2, None),
    "paper_2gpu_model": ("model", 2, {"batch": 1, "model": 2}),
    "paper_4gpu_data": ("data", 4, None),
    "paper_4gpu_hybrid": ("hybrid", 4, {"batch": 2, "model": 2}),
}


def test_every_flagfile_opens_with_its_command():
    paths = glob.glob(os.path.join(REPO, "flags", "*.flags"))
    assert len(paths) >= len(PAPER) + 2, paths   # the paper's, their shared flags and the quick start
    for path in paths:
        first = open(path).readline()
        if os.path.basename(path) == "paper_common.flags":
            assert first.startswith("# Shared by"), path
        else:
            assert first.startswith(f"# tf-multigpu-train --flagfile=flags/{os.path.basename(path)}"), path


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_configuration_builds(name, tmp_path):
    """--steps=0 builds the model on the configuration's devices and evaluates it; the
    overrides swap ImageNet for synthetic data at 64x64 so it runs anywhere."""
    done = run_cli(f"--flagfile=flags/{name}.flags", f"--run_dir={tmp_path / 'run'}", "--dataset=synthetic",
                   "--image_size=64", "--steps=0", "--noexport", "--cpu_devices=4", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    strategy, devices, mesh = PAPER[name]
    assert (summary["strategy"], len(summary["devices"]), summary["global_batch"], summary["model"]) == (
        strategy, devices, 256, "alexnet")
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert (config["learning_rate"], config["momentum"], config["weight_decay"], config["lr_schedule"]) == (
        0.01, 0.9, 5e-4, "step")
    if mesh:
        assert config["mesh"] == f"batch:{mesh['batch']},model:{mesh['model']}"
