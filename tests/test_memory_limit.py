"""--device_memory_limit (RQ5): a run that does not fit says so in one line with exit status 3
before writing anything, and `python -m tools.max_batch` finds the largest global batch that fits."""

import json
import os

import pytest

from tests.conftest import run_cli
from tests.launcher import run_module
from tf_multigpu.cli import DOES_NOT_FIT


def test_a_run_over_the_memory_limit_exits_3_and_names_the_largest_batch(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(f"--run_dir={run_dir}", "--cpu_devices=2", "--batch_size=1024", "--device_memory_limit=16",
                   "--steps=1")
    assert done.returncode == DOES_NOT_FIT, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert "needs about 40 MiB per device but --device_memory_limit=16: use --batch_size<=302," in line, line
    assert not run_dir.exists()   # nothing written


def test_the_same_run_within_the_limit_trains(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--cpu_devices=2", "--batch_size=64", "--device_memory_limit=16",
                   "--steps=1", "--noexport")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["memory_per_device_bytes"]["total"] <= 16 * 2**20 and summary["export_dir"] is None


def test_logical_gpus_need_a_memory_limit(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--logical_gpus=2")
    assert done.returncode == 2
    assert "--logical_gpus=2 needs --device_memory_limit=MiB" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_max_batch_finds_the_boundary(tmp_path):
    done = run_module("tools.max_batch", "--model=small_convnet", "--dataset=digits", "--device_memory_limit=16",
                      "--strategies=data", "--cpu_devices=2", "--start_batch=256", "--max_batch=1024",
                      "--resolution=128", f"--out_dir={tmp_path}", timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.load(open(os.path.join(tmp_path, "max_batch.json")))["rows"]
    # The estimate allows 302 for small_convnet on 2 devices with 16 MiB: 256 fits, 512 does not,
    # and the bisection finds that 384 does not either.
    assert rows == [{"strategy": "data", "devices": 2, "largest_global_batch": 256}]
    assert "| data | 2 | 256 |" in open(os.path.join(tmp_path, "max_batch.md")).read()
