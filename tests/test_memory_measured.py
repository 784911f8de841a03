"""Memory measured (RQ5): the process's peak RSS and its baseline reach summary.json, and
tools/memory_table.py turns fresh runs into the estimate-against-measured table."""

import ctypes
import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests.conftest import REPO, run_cli
from tests.launcher import run_code, run_module
from tf_multigpu.profiling.memory_measured import MemoryMeter, malloc_free_bytes, peak_rss_bytes, rss_bytes


def test_meter_on_cpus_reports_the_process(devices):
    measured = MemoryMeter(devices[:2]).measured()
    assert measured["baseline_rss_bytes"] > 0 and measured["peak_rss_bytes"] >= measured["baseline_rss_bytes"]
    assert measured["peak_minus_baseline_bytes"] == measured["peak_rss_bytes"] - measured["baseline_rss_bytes"]
    assert 0 < rss_bytes() <= peak_rss_bytes()
    assert measured["malloc_free_bytes"] >= 0   # Linux with glibc, as on CI
    assert measured.get("ld_preload", "") == os.environ.get("LD_PRELOAD", "")   # named only when set


def test_meter_names_a_preloaded_allocator(devices, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert MemoryMeter(devices[:1]).measured()["ld_preload"].endswith("libtcmalloc_minimal.so.4")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2 (Linux; CI runs it)")
def test_malloc_free_bytes_counts_what_glibc_keeps():
    """Blocks freed between live ones cannot go back to the system: glibc keeps them in its
    arena, and mallinfo2 counts them. 100 KiB blocks stay under malloc's mmap threshold (128
    KiB at start), so they come from the arena. glibc's own malloc, as the reading is glibc's
    own: with tcmalloc preloaded (the README's advice) both still see glibc's arenas."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(100 * 1024) for _ in range(640)]   # 62.5 MiB
    before = malloc_free_bytes()
    for block in blocks[::2]:
        libc.free(block)
    kept = malloc_free_bytes() - before
    for block in blocks[1::2]:
        libc.free(block)
    assert 30 * 2**20 <= kept <= 40 * 2**20, kept   # the 320 freed blocks: 31.25 MiB


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["1", "0"])
def test_a_fresh_process_peak_counts_what_it_allocates(onednn):
    """256 MiB allocated after the meter starts shows in peak minus baseline, and a larger
    transient freed before it starts (TensorFlow's import, a decoded data set) does not. With
    oneDNN off (TF_ENABLE_ONEDNN_OPTS=0) TensorFlow's CPU allocator keeps no statistics: the
    meter still measures the process, without an allocator peak."""
    code = ("import numpy as np, json\n"
            "from tf_multigpu.profiling.memory_measured import MemoryMeter\n"
            "t = np.ones(768 * 2**20 // 8); del t\n"
            "m = MemoryMeter(['/device:CPU:0'])\n"
            "b = np.ones(256 * 2**20 // 8)\n"
            "print(json.dumps(m.measured()))\n")
    # A clean environment: variables earlier tests left in this process' (the graph dump's
    # TF_DUMP_GRAPH_PREFIX) must not change what a fresh process allocates.
    clean = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**clean, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2",
                               "TF_ENABLE_ONEDNN_OPTS": onednn})
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["peak_since"] == "meter start", measured   # Linux resets the high-water mark
    assert 250 * 2**20 <= measured["peak_minus_baseline_bytes"] < 400 * 2**20, measured
    assert measured["cpu_kernels"] == ("oneDNN" if onednn == "1" else "Eigen"), measured
    if onednn == "1":
        assert measured["tf_allocator_peak_bytes"] < 2**20, measured   # numpy's memory is not TensorFlow's
    else:
        assert "tf_allocator_peak_bytes" not in measured, measured


def test_allocator_peak_counts_tensors():
    """With oneDNN on, TensorFlow's CPU allocator counts a tensor of any logical device. Run
    with TF_ENABLE_ONEDNN_OPTS=1: TensorFlow turns oneDNN on by itself only on some CPUs (on an
    AMD EPYC with AVX2 but no AVX-512 it was off, and the allocator kept no statistics)."""
    code = ("import json, tensorflow as tf\n"
            "from tf_multigpu.parallel import configure_devices\n"
            "from tf_multigpu.profiling.memory_measured import MemoryMeter\n"
            "devices = configure_devices(2, 2)\n"
            "meter = MemoryMeter(devices)\n"
            "with tf.device(devices[1]):\n"
            "    t = tf.ones([64 * 2**20 // 4])   # 64 MiB on the second logical device\n"
            "    print(json.dumps(meter.measured()))\n")
    done = run_code(code, env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["tf_allocator_peak_bytes"] >= 64 * 2**20


@pytest.mark.slow
def test_summary_reports_the_measured_peak_beside_the_estimate(tmp_path):
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--cpu_devices=2", "--strategy=model", "--batch_size=32",
                   "--steps=1", "--noexport")
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    measured = summary["memory_measured"]
    assert measured["peak_rss_bytes"] > measured["baseline_rss_bytes"] > 0
    assert summary["memory_per_device_bytes"]["total"] > 0
    digits = 8 * 8 * 1   # the default data set's images; 6 float32 batches of 32 in flight
    assert summary["memory_host_bytes"] == {"input_pipeline": 6 * 32 * digits * 4, "total": 6 * 32 * digits * 4}
    tags = {v.tag for root, _, files in os.walk(tmp_path / "run") for f in files if "tfevents" in f
            for event in tf.compat.v1.train.summary_iterator(os.path.join(root, f)) for v in event.summary.value}
    assert {"memory_measured/peak_rss_bytes", "memory_per_device/total_bytes"} <= tags, sorted(tags)


@pytest.mark.slow
def test_the_hybrid_estimate_meets_the_allocators_peak(tmp_path):
    """A hybrid 2x2 step's gradients are all-reduced one after another after the backward, and
    each update waits for its own (parallel/memory.py, `_updated_after_backward`): the updates
    never meet the backward's activations, nor each other. AlexNet 128/32 on 4 logical CPUs,
    one step, oneDNN on for the allocator's statistics: the estimate summed over the devices,
    plus the input pipeline, is 1.12x the allocator's peak (1,084 against 964 MiB, 2026-12-07);
    counting every update during the backward, and a new tensor per all-reduce, it was 1.74x."""
    done = run_cli(f"--run_dir={tmp_path / 'run'}", "--model=alexnet", "--dataset=synthetic", "--image_size=128",
                   "--batch_size=32", "--steps=1", "--noexport", "--strategy=hybrid", "--cpu_devices=4",
                   "--num_devices=4", "--mesh=batch:2,model:2", "--layout=filter_split",
                   env={"TF_ENABLE_ONEDNN_OPTS": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    estimate = 4 * summary["memory_per_device_bytes"]["total"] + summary["memory_host_bytes"]["total"]
    ratio = estimate / summary["memory_measured"]["tf_allocator_peak_bytes"]
    assert 0.8 <= ratio <= 1.3, (ratio, summary["memory_per_device_bytes"], summary["memory_measured"])


def test_table_rows_and_markdown():
    sys.path.insert(0, REPO)
    from tools.memory_table import markdown, row
    summaries = {
        "single": {"devices": ["cpu0"], "memory_per_device_bytes": {"total": 2**30},
                   "memory_measured": {"peak_rss_bytes": 3 * 2**30, "baseline_rss_bytes": 2**30,
                                       "peak_minus_baseline_bytes": 2 * 2**30}},
        "model 1x2 filter_split": {"devices": ["cpu0", "cpu1"], "memory_per_device_bytes": {"total": 2**30},
                                   "memory_host_bytes": {"total": 2**29},
                                   "memory_measured": {"peak_rss_bytes": 6 * 2**30, "baseline_rss_bytes": 2**30,
                                                       "peak_minus_baseline_bytes": 5 * 2**30}},
    }
    rows = [row(label, s) for label, s in summaries.items()]
    assert rows[1]["estimate_bytes"] == 2.5 * 2**30   # per device x devices + the host's input, on CPU
    table = markdown(rows)
    assert "| single | 3.00 GiB | 1.00 | 1.00 GiB | 2.00 GiB | 0.50 | - |" in table
    assert "| model 1x2 filter_split | 6.00 GiB | 2.00 | 2.50 GiB | 5.00 GiB | 0.50 | - |" in table
    assert "CPU kernels" not in table and "Peaks of every run" not in table   # neither said by these runs
    assert "glibc" not in table and "LD_PRELOAD" not in table
    summaries["model 1x2 filter_split"]["memory_measured"]["malloc_free_bytes"] = 2**29
    for summary in summaries.values():
        summary["memory_measured"]["ld_preload"] = "/usr/lib/libtcmalloc_minimal.so.4"
        summary["memory_measured"]["malloc_library"] = "/usr/lib/libtcmalloc_minimal.so.4.5.10"
    table = markdown([row(label, s) for label, s in summaries.items()])
    assert "Preloaded (LD_PRELOAD): /usr/lib/libtcmalloc_minimal.so.4." in table
    assert "malloc from: /usr/lib/libtcmalloc_minimal.so.4.5.10." in table
    assert "Held free by glibc's malloc when training ended (freed memory its arenas keep, mostly resident, " \
           "in no tensor): model 1x2 filter_split 0.50 GiB." in table


def test_table_keeps_the_median_run_and_names_the_kernels():
    """One device's peak moves from run to run; --repeats keeps the median run and lists all."""
    sys.path.insert(0, REPO)
    from tools.memory_table import markdown, median_run, row

    def summary(peak_gib):
        return {"devices": ["cpu0"], "memory_per_device_bytes": {"total": 2**30},
                "memory_measured": {"peak_rss_bytes": int(peak_gib * 2**30), "baseline_rss_bytes": 2**30,
                                    "peak_minus_baseline_bytes": int((peak_gib - 1) * 2**30),
                                    "cpu_kernels": "Eigen"}}
    chosen = median_run([row("single", summary(g)) for g in (2.8, 2.5, 2.6)])
    assert chosen["peak_bytes"] == int(2.6 * 2**30) and len(chosen["peaks_bytes"]) == 3
    assert median_run([row("single", summary(g)) for g in (2.8, 2.5)])["peak_bytes"] == int(2.5 * 2**30)
    table = markdown([chosen])
    assert "| single | 2.60 GiB | 1.00 |" in table
    assert "CPU kernels: Eigen." in table and " |\n\nBaseline" in table   # notes below, not rows
    assert "Peaks of every run (GiB; the median run is shown): single 2.80, 2.50, 2.60." in table


@pytest.mark.slow
def test_memory_table_tool_runs_fresh_processes(tmp_path):
    out = tmp_path / "table.md"
    done = run_module("tools.memory_table", "--model=small_convnet", "--dataset=digits", "--batch_size=32",
                      "--train_steps=1", "--configs=single,model_1x2_filter_split", f"--out={out}", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "table.json").read_text())
    assert [r["config"] for r in rows] == ["single", "model 1x2 filter_split"]
    assert rows[0]["cpu_kernels"] in ("oneDNN", "Eigen") and "CPU kernels: " in done.stdout
    assert rows[1]["devices"] == 2 and all(r["peak_bytes"] > r["baseline_bytes"] > 0 for r in rows)
    assert "| model 1x2 filter_split |" in out.read_text() and "| model 1x2 filter_split |" in done.stdout


def test_memory_table_names_an_unknown_config():
    done = run_module("tools.memory_table", "--configs=single,model_9x9", timeout=120)
    assert done.returncode != 0
    assert "--configs: unknown model_9x9" in done.stderr


def test_memory_table_checks_malloc_before_its_first_run():
    done = run_module("tools.memory_table", "--configs=single", "--malloc=jemalloc", timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("memory_table: error: --malloc=jemalloc is not one of auto, system, tcmalloc"), last
    assert "single ..." not in done.stderr   # no run was started


def test_allocations_are_listed_by_op_and_by_family_of_three_or_more():
    from tf_multigpu.profiling.xspace import _grouped
    mib = 2**20
    alive = [("g/fc6/MatMul/MatMul_1", 72 * mib)] * 4 + [("g/fc6/MatMul/MatMul", mib)] + [
        (f"conv2/activation_gradients/strided_slice_{i}", mib) for i in range(14)] + [("Cast", 2 * mib)]
    assert _grouped(alive) == [("g/fc6/MatMul/MatMul_1", 4, 288 * mib),
                               ("conv2/activation_gradients/strided_slice_*", 14, 14 * mib),
                               ("Cast", 1, 2 * mib), ("g/fc6/MatMul/MatMul", 1, mib)]


@pytest.mark.slow
def test_memory_peak_lists_what_is_alive_at_the_allocators_peak(tmp_path):
    """tools/memory_peak.py on a profiled run: the allocator's peak and the tensors alive at it
    (oneDNN on: TensorFlow's own CPU kernels record no allocation events, and the tool says
    so). One device: its peak is in the backward, at a gradient op (a MaxPoolGrad in five runs
    of five here) or at the momentum update that runs as soon as a gradient appears (CI, one
    run), with backward tensors alive either way. The default data parallelism peaked at its
    packed all-reduce in one run of three, with no gradient_tape tensor alive."""
    from tf_multigpu.profiling.xspace import allocations_at_peak, latest_trace
    run_dir = tmp_path / "run"
    done = run_cli(f"--run_dir={run_dir}", "--strategy=single", "--steps=3", "--profile_steps=2,2", "--noexport",
                   env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    shown = run_module("tools.memory_peak", f"--run_dir={run_dir}", "--top=100")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("## Allocator "), shown.stdout
    rows = [line for line in shown.stdout.splitlines() if line.startswith("| `")]
    assert any("gradient_tape" in row for row in rows), shown.stdout
    (peak,) = allocations_at_peak(latest_trace(str(run_dir / "tensorboard"))).values()
    assert "gradient_tape" in peak["peak_op"] or "momentum_sgd" in peak["peak_op"], peak["peak_op"]
    # in use at the peak: what was in use before the trace, less what of it was freed, plus
    # what the trace allocated and still holds
    assert 0 < peak["peak_bytes"] - peak["start_bytes"] <= sum(b for _, _, b in peak["alive"])

    from tf_multigpu.compat import xplane_pb2
    empty = tmp_path / "empty" / "tensorboard" / "plugins" / "profile" / "1"
    empty.mkdir(parents=True)
    (empty / "host.xplane.pb").write_bytes(xplane_pb2().XSpace().SerializeToString())
    refused = run_module("tools.memory_peak", f"--run_dir={tmp_path / 'empty'}")
    assert refused.returncode == 2 and "has no allocation events" in refused.stderr.strip().splitlines()[-1]
    corrupt = tmp_path / "corrupt" / "tensorboard" / "plugins" / "profile" / "1"
    corrupt.mkdir(parents=True)
    (corrupt / "host.xplane.pb").write_bytes(b"\xff" * 64)
    refused = run_module("tools.memory_peak", f"--run_dir={tmp_path / 'corrupt'}")
    assert refused.returncode == 2 and "is not a profiler trace" in refused.stderr.strip().splitlines()[-1]
    missing = run_module("tools.memory_peak", f"--run_dir={tmp_path / 'none'}")
    assert missing.returncode == 2 and "--profile_steps=A,B" in missing.stderr.strip().splitlines()[-1]
