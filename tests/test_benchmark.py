"""tools/benchmark.py and tools/convergence.py: the sweeps run and their outputs parse.

The end-to-end checks start the tools as a user would, each in a process of its own
(tests/launcher.py; the sweep itself starts a fresh process per configuration); the
statistics and tables are also checked on made-up rows.
"""

import csv
import importlib.util
import json

import pytest

from tests.launcher import run_module
from tools.bench import report
from tools.bench.configs import BenchRun, grid, paper_runs, peer_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TORCH = importlib.util.find_spec("torch") is not None


def _tool(name, *args, timeout=300):
    module = "tools." + name.removesuffix(".py")
    return run_module(module, *args, timeout=timeout)


def _assert_png(path):
    import matplotlib.image
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, path
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height >= 200 and width >= 300, (path, height, width)


def _read_csv(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.mark.slow
def test_smoke_sweep_writes_tables_and_plots(tmp_path):
    done = _tool("benchmark.py", "--smoke", f"--out_dir={tmp_path}")
    assert done.returncode == 0, done.stderr[-3000:]

    header, rows = _read_csv(tmp_path / "results.csv")
    assert tuple(header) == report.COLUMNS
    ours = [r for r in rows if r["kind"] == "ours"]
    assert [(r["strategy"], r["devices"]) for r in ours] == [("single", "1"), ("data", "2"), ("model", "2")]
    for r in ours:
        assert not r["error"], r
        assert float(r["images_per_s_p10"]) <= float(r["images_per_s_median"]) <= float(r["images_per_s_p90"])
        assert float(r["speedup"]) == pytest.approx(float(r["efficiency"]) * int(r["devices"]))
        assert int(r["memory_total_bytes"]) > 0
        # the traced split adds up to the median step time
        assert float(r["compute_s"]) + float(r["communication_s"]) == pytest.approx(float(r["step_time_median_s"]))
    assert float(ours[0]["communication_s"]) == 0   # one device: no collectives
    assert float(ours[1]["communication_s"]) > 0 and float(ours[2]["communication_s"]) > 0
    assert float(ours[0]["speedup"]) == 1.0
    # model parallelism halves the parameters each device holds
    assert int(ours[2]["memory_parameters_bytes"]) < int(ours[1]["memory_parameters_bytes"])
    peers = {(r["kind"], r["devices"]): r for r in rows if r["kind"] != "ours"}
    assert set(peers) == {(p, n) for p in ("keras_fit", "torch_ddp") for n in ("1", "2")}
    assert not peers[("keras_fit", "2")]["error"] and float(ours[1]["ours_vs_keras_fit"]) > 0
    if TORCH:
        assert not peers[("torch_ddp", "2")]["error"] and float(ours[1]["ours_vs_torch_ddp"]) > 0
        assert peers[("torch_ddp", "2")]["parameters"] == ours[1]["parameters"]
    else:
        assert peers[("torch_ddp", "2")]["error"].startswith("torch not installed")

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["mode"] == "smoke" and len(results["rows"]) == len(rows)

    table = (tmp_path / "results.md").read_text()
    for label in ("| 1 CPU |", "| 2 CPUs data |", "| 2 CPUs model |"):
        assert table.count(label) == 1, label                      # the table of every configuration
    for name in ("| 1 GPU |", "| 2 GPUs data |", "| 2 GPUs model |", "| 4 GPUs data | not run"):
        assert name in table, name                                 # the paper's layout
    assert "ours / Keras fit" in table and "ours / PyTorch DDP" in table
    for name in ("speedup.png", "throughput.png", "memory.png"):
        _assert_png(tmp_path / name)


@pytest.mark.parametrize("args, message", [
    (["--smoke", "--nosuch"], "Unknown command line flag 'nosuch'"),
    (["--out_dir=x", "--devices=1,two"], "--devices=1,two must be comma-separated integers"),
    (["--out_dir=x", "--strategies=single,bogus"], "unknown strategy 'bogus'"),
    (["--out_dir=x", "--peers=jax"], "unknown peer 'jax'"),
    (["--out_dir=x", "--paper", "--smoke"], "give one of them"),
    (["--out_dir=x", "--paper", "--devices=2"], "--paper sets its own configurations: drop --devices"),
    (["--out_dir=x", "--timed_steps=0"], "--timed_steps=0 must be >= 1"),
    (["--out_dir=x", "--paper", "--cpu_devices=2"], "use --cpu_devices=4"),
    (["--out_dir=x", "--strategies=hybrid", "--devices=1,2"], "no configuration exists"),
    (["--smoke"], "--out_dir is required"),
])
def test_benchmark_bad_flags_exit_2_with_one_line(args, message):
    done = _tool("benchmark.py", *args, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("benchmark: error:") and message in lines[0], done.stderr


def test_convergence_bad_configs_exit_2_with_one_line():
    done = _tool("convergence.py", "--out_dir=x", "--configs=single:2", timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[0]] and "single runs on 1 device" in lines[0], done.stderr


@pytest.mark.slow
def test_convergence_writes_curves(tmp_path):
    done = _tool("convergence.py", f"--out_dir={tmp_path}", "--configs=single:1,data:2", "--steps=20",
                 "--eval_every=10", "--batch_size=32")
    assert done.returncode == 0, done.stderr[-3000:]
    header, rows = _read_csv(tmp_path / "convergence.csv")
    assert tuple(header) == ("label", "strategy", "devices", "step", "wall_s", "test_accuracy", "test_error",
                             "test_loss")
    for strategy in ("single", "data"):
        curve = [r for r in rows if r["strategy"] == strategy]
        assert [int(r["step"]) for r in curve] == [10, 20]
        assert 0 < float(curve[0]["wall_s"]) < float(curve[1]["wall_s"])
        for r in curve:
            assert float(r["test_error"]) == pytest.approx(1 - float(r["test_accuracy"]))
    table = (tmp_path / "convergence.md").read_text()
    assert "| 1 CPU |" in table and "| 2 CPUs data |" in table
    _assert_png(tmp_path / "convergence.png")


def _raw(kind, strategy, devices, times, batch=64, **extra):
    run = BenchRun(kind, strategy, devices, "small_convnet", batch, dataset="digits")
    return {**run.__dict__, "mesh": run.mesh, "step_times_s": times, "device_kind": "CPU", **extra}


def test_report_speedup_efficiency_and_peer_ratios():
    rows = report.summarize([
        _raw("ours", "single", 1, [0.10, 0.10, 0.30], memory_bytes={"total": 2**20}),
        _raw("ours", "data", 2, [0.05, 0.05, 0.05]),
        _raw("keras_fit", "data", 2, [0.10, 0.10, 0.10]),
        _raw("torch_ddp", "data", 2, [], error="torch not installed (pip install -e '.[torch]')"),
    ])
    single, data, keras_fit, torch_ddp = rows
    assert single["step_time_median_s"] == pytest.approx(0.10)
    assert single["images_per_s_median"] == pytest.approx(640)
    assert single["images_per_s_p10"] == pytest.approx(64 / 0.30 + 0.2 * (640 - 64 / 0.30))
    assert data["speedup"] == pytest.approx(2.0) and data["efficiency"] == pytest.approx(1.0)
    assert data["ours_vs_keras_fit"] == pytest.approx(2.0) and data.get("ours_vs_torch_ddp") is None
    assert keras_fit["speedup"] is None   # no one-device Keras run to compare with
    assert torch_ddp["images_per_s_median"] is None and torch_ddp["error"].startswith("torch not installed")
    assert single["memory_total_bytes"] == 2**20 and data["memory_total_bytes"] is None
    table = report.markdown(rows, {"mode": "test"})
    assert "| 2 GPUs data | 50.0 | 1280.0 (1280-1280) | 2.00 | 100% | 1.5 |" in table
    assert "| 2 GPUs model | not run |" in table
    assert "torch not installed" in table


def test_sweeps_list_the_configurations_that_exist():
    runs = grid(["single", "data", "model", "hybrid"], [1, 2, 4], [64, 6], ["alexnet"])
    assert [(r.strategy, r.devices, r.batch) for r in runs] == [
        ("single", 1, 64), ("data", 2, 64), ("data", 4, 64), ("model", 2, 64), ("model", 4, 64), ("hybrid", 4, 64),
        ("single", 1, 6), ("data", 2, 6), ("model", 2, 6), ("model", 4, 6), ("hybrid", 4, 6)]   # 6 rows: not 4 replicas
    paper = paper_runs()
    assert [(r.strategy, r.devices, r.mesh) for r in paper] == [
        ("single", 1, ""), ("data", 2, ""), ("model", 2, "batch:1,model:2"), ("data", 4, ""),
        ("hybrid", 4, "batch:2,model:2")]
    assert all(r.model == "alexnet" and r.batch == 256 for r in paper)
    peers = peer_runs(paper, ["keras_fit", "torch_ddp"])
    assert sorted((r.kind, r.devices) for r in peers) == sorted(
        (k, n) for k in ("keras_fit", "torch_ddp") for n in (1, 2, 4))


@pytest.mark.skipif(not TORCH, reason="PyTorch is the optional `torch` extra")
@pytest.mark.parametrize("model, shape, classes", [
    ("small_convnet", (8, 8, 1), 10), ("small_convnet", (16, 16, 3), 1000),
    ("alexnet", (64, 64, 3), 1000), ("alexnet", (224, 224, 3), 1000)])
def test_torch_twins_have_our_parameter_counts(model, shape, classes):
    from tf_multigpu.models import build_model
    from tools.bench.torch_models import build
    twin = build(model, shape, classes)
    assert sum(p.numel() for p in twin.parameters()) == build_model(model, shape, classes).count_params()
