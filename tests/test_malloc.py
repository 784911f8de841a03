"""--malloc: a training process started again with TCMalloc (or another allocator) preloaded,
before TensorFlow starts, and the warning a run gives where glibc's malloc kept much of its
peak.

The tests that need TCMalloc installed are skipped where it is not (a user's machine that has
not installed it); CI installs Debian's libtcmalloc-minimal4 (.ci/run) and runs them."""

import json
import logging
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.helpers import exit_before_tensorflow
from tf_multigpu import malloc
from tf_multigpu.config import Config
from tf_multigpu.errors import UsageError
from tf_multigpu.profiling.memory_measured import malloc_advice
from tf_multigpu.training import loop

GIB = 2**30


def _tcmalloc():
    try:
        return malloc.library_path("tcmalloc")
    except UsageError:
        return None


TCMALLOC = _tcmalloc()
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="TCMalloc is not installed (CI installs it: .ci/run)")


def test_malloc_values_are_checked(tmp_path):
    assert malloc.library_path("system") is None   # nothing to preload
    for value in ("system", "tcmalloc"):
        Config(run_dir=str(tmp_path), malloc=value).validate()
    library = tmp_path / "libmine.so"
    library.write_bytes(b"")
    Config(run_dir=str(tmp_path), malloc=str(library)).validate()   # a file: the loader judges it
    with pytest.raises(UsageError, match=r"^--malloc=jemalloc is not one of system, tcmalloc or a library's path"):
        Config(run_dir=str(tmp_path), malloc="jemalloc").validate()
    with pytest.raises(UsageError, match=r"^--malloc=/no/such/libjemalloc.so.2: no such file"):
        Config(run_dir=str(tmp_path), malloc="/no/such/libjemalloc.so.2").validate()


def test_a_bad_value_stops_before_tensorflow(tmp_path):
    status, imported, line = exit_before_tensorflow("tf_multigpu.train", "tf-multigpu-train", f"--run_dir={tmp_path}",
                                                    "--malloc=jemalloc")
    assert (status, imported) == (2, False)
    assert line.startswith("tf-multigpu-train: error: --malloc=jemalloc is not one of"), line


@needs_tcmalloc
def test_tcmalloc_is_found():
    assert os.path.basename(TCMALLOC) in malloc.TCMALLOC_LIBRARIES and os.path.isfile(TCMALLOC)


def test_a_missing_tcmalloc_names_its_package(monkeypatch, tmp_path):
    monkeypatch.setattr(malloc, "_LIBRARY_DIRS", (str(tmp_path),))
    with pytest.raises(UsageError, match=r"--malloc=tcmalloc: TCMalloc's library .* is not installed: "
                                         r"install it \(Debian/Ubuntu: apt install libtcmalloc-minimal4"):
        malloc.library_path("tcmalloc")


PROBE = """import sys
from tf_multigpu import malloc
malloc.apply(sys.argv[1])
print(sys.flags.optimize, sys.flags.utf8_mode, sys.argv[1:], malloc.malloc_library())
"""


@needs_tcmalloc
@pytest.mark.parametrize("how", ["script", "module"])
def test_the_process_starts_again_with_its_options_and_arguments(tmp_path, how):
    """`python -O -X utf8 probe.py ARGS` and `python -O -X utf8 -m probe ARGS` come back with
    their interpreter options and arguments, and TCMalloc's malloc is the one they call."""
    (tmp_path / "probe.py").write_text(PROBE)
    target = ["probe.py"] if how == "script" else ["-m", "probe"]
    done = subprocess.run([sys.executable, "-O", "-X", "utf8", *target, "tcmalloc", "--x=1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"1 1 ['tcmalloc', '--x=1'] {os.path.realpath(TCMALLOC)}", done.stdout


def test_python_c_cannot_start_again_and_says_so():
    done = subprocess.run([sys.executable, "-c", PROBE, "/etc/hostname"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and "is not a program file: run tf-multigpu-train or python -m " \
                                   "tf_multigpu.train, or set LD_PRELOAD yourself" in done.stderr, done.stderr


@pytest.mark.slow
@needs_tcmalloc
def test_a_run_with_tcmalloc_runs_under_it(tmp_path):
    """The installed console script starts again with TCMalloc preloaded: the meter finds
    TCMalloc's malloc serving the process (dladdr), not merely named in LD_PRELOAD, and
    config.json records the flag."""
    script = os.path.join(os.path.dirname(sys.executable), "tf-multigpu-train")
    done = subprocess.run([script, f"--run_dir={tmp_path / 'run'}", "--strategy=single", "--batch_size=32",
                           "--steps=2", "--noexport", "--malloc=tcmalloc"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout   # one run's summary: the first process printed nothing
    measured = json.loads(lines[0])["memory_measured"]
    assert measured["malloc_library"] == os.path.realpath(TCMALLOC), measured
    assert measured["ld_preload"] == TCMALLOC, measured
    assert json.load(open(tmp_path / "run" / "config.json"))["malloc"] == "tcmalloc"


def test_a_library_the_loader_refuses_is_one_line(tmp_path):
    """An existing file that is no shared library: the loader says why, then ignores it; the
    process started again (as `python -m tf_multigpu.train`, which it parses: the error is
    about its flag) stops with one line instead of starting a third time."""
    bogus = tmp_path / "libnot.so"
    bogus.write_text("not an ELF file\n")
    done = subprocess.run([sys.executable, "-m", "tf_multigpu.train", f"--run_dir={tmp_path / 'run'}",
                           f"--malloc={bogus}"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tf-multigpu-train: error: --malloc={bogus}: the loader would not make {bogus} "
                           "this process's malloc"), last
    assert "cannot be preloaded" in done.stderr   # ld.so's own reason, above it
    assert not (tmp_path / "run").exists()


def test_advice_where_glibc_kept_much_of_the_peak():
    kept = {"peak_rss_bytes": 3 * GIB, "malloc_free_bytes": int(1.21 * GIB), "cpu_kernels": "Eigen"}   # model 1x4
    assert malloc_advice(kept).startswith("glibc's malloc held 1.21 GiB free when training ended, of a 3.00 GiB peak")
    assert "--malloc=tcmalloc" in malloc_advice(kept)
    assert malloc_advice({**kept, "cpu_kernels": "oneDNN"}) is None   # TCMalloc saved nothing there
    assert malloc_advice({**kept, "ld_preload": "/usr/lib/libtcmalloc_minimal.so.4"}) is None
    assert malloc_advice({**kept, "malloc_library": "/usr/lib/libtcmalloc_minimal.so.4.5.10"}) is None
    # something preloaded that is no allocator: glibc's malloc still serves the process
    assert malloc_advice({**kept, "ld_preload": "/usr/lib/libfoo.so", "malloc_library": "/lib/libc.so.6"})
    assert malloc_advice({**kept, "malloc_free_bytes": int(0.08 * GIB)}) is None   # one device
    assert malloc_advice({**kept, "peak_rss_bytes": 600 * 2**20, "malloc_free_bytes": 200 * 2**20}) is None   # small
    assert malloc_advice({"peak_bytes_per_device": {}}) is None   # GPUs


def test_a_run_that_kept_much_logs_the_advice(tmp_path, devices, monkeypatch, caplog):
    monkeypatch.setattr(loop, "malloc_advice", lambda measured: "ADVICE " + str(sorted(measured)[:1]))
    with caplog.at_level(logging.WARNING):
        loop.train(Config(run_dir=str(tmp_path / "run"), strategy="single", steps=1, batch_size=32, export=False),
                   devices[:1])
    advice = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ADVICE")]
    assert advice == ["ADVICE ['baseline_rss_bytes']"]   # once, given the run's measurement
