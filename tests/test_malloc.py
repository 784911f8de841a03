"""--malloc: a training process started again with TCMalloc (or another allocator) preloaded,
before TensorFlow starts -- by default (`auto`) where TensorFlow will run its own CPU kernels --
and the warning a run gives where glibc's malloc kept much of its peak.

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


def test_malloc_values_are_checked(tmp_path, monkeypatch):
    assert malloc.library_path("system") is None   # nothing to preload
    # ... and the log names the library that serves malloc, a user's own preload included
    monkeypatch.setattr(malloc, "malloc_library", lambda: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert malloc.apply("system") == "malloc: /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 (--malloc=system)"
    for value in ("auto", "system", "tcmalloc"):
        Config(run_dir=str(tmp_path), malloc=value).validate()
    library = tmp_path / "libmine.so"
    library.write_bytes(b"")
    Config(run_dir=str(tmp_path), malloc=str(library)).validate()   # a file: the loader judges it
    with pytest.raises(UsageError, match=r"^--malloc=jemalloc is not one of auto, system, tcmalloc or a library's"):
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


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_tensorflow_says_which_kernels_it_will_run_before_it_starts(onednn, monkeypatch):
    """TensorFlow's own answer, asked of a child process: what compat.onednn_enabled reads in a
    process that runs TensorFlow (TF_ENABLE_ONEDNN_OPTS decides over the CPU's default)."""
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", onednn)
    assert malloc.tensorflow_runs_onednn() is (onednn == "1")


def test_auto_chooses_tcmalloc_only_for_tensorflows_own_kernels(monkeypatch, tmp_path):
    # glibc's serves malloc and nothing was asked of the loader, whatever runs the test
    monkeypatch.setattr(malloc, "malloc_library", lambda: "/lib/x86_64-linux-gnu/libc.so.6")
    monkeypatch.delenv(malloc._REQUESTED, raising=False)
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO, "tf_multigpu", "train.py")])   # a program: can restart
    monkeypatch.setattr(malloc, "_LIBRARY_DIRS", (str(tmp_path),))
    library = tmp_path / malloc.TCMALLOC_LIBRARIES[0]
    library.write_bytes(b"")
    monkeypatch.setattr(malloc, "tensorflow_runs_onednn", lambda: False)   # Eigen's kernels
    assert malloc.auto_choice() == (str(library), malloc._WHY_TCMALLOC.format(library))
    monkeypatch.setattr(malloc, "tensorflow_runs_onednn", lambda: True)
    path, why = malloc.auto_choice()
    assert path is None and why.startswith("glibc's (TensorFlow runs oneDNN's CPU kernels here")
    assert malloc.apply("auto").startswith("malloc: glibc's (TensorFlow runs oneDNN's")   # and no restart
    monkeypatch.setattr(malloc, "tensorflow_runs_onednn", lambda: None)
    assert malloc.auto_choice()[0] is None
    monkeypatch.setattr(malloc, "tensorflow_runs_onednn", lambda: False)
    library.unlink()   # TCMalloc not installed: glibc's, and the line names the package
    path, why = malloc.auto_choice()
    assert path is None and "is not installed: Debian/Ubuntu: apt install libtcmalloc-minimal4" in why
    library.write_bytes(b"")
    monkeypatch.setattr(malloc, "malloc_library", lambda: "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert malloc.auto_choice() == (None, "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2, which serves malloc already")
    monkeypatch.setattr(malloc, "malloc_library", lambda: "/lib/x86_64-linux-gnu/libc.so.6")
    monkeypatch.setenv(malloc._REQUESTED, str(library))   # started again with it, and glibc's still serves
    assert malloc.auto_choice()[1].startswith(f"glibc's: the loader would not preload {library}")
    monkeypatch.setattr(malloc, "malloc_library", lambda: os.path.realpath(library))   # ... it serves: done
    assert malloc.auto_choice() == (str(library), malloc._WHY_TCMALLOC.format(library))
    monkeypatch.setattr(malloc, "malloc_library", lambda: "/lib/x86_64-linux-gnu/libc.so.6")
    monkeypatch.delenv(malloc._REQUESTED)
    monkeypatch.setattr(sys, "argv", ["-c"])   # python -c: keeps glibc's, no error
    monkeypatch.setattr(sys.modules["__main__"], "__spec__", None)
    assert malloc.auto_choice() == (None, "glibc's ('-c' cannot be started again with another malloc)")


@pytest.mark.slow
@needs_tcmalloc
@pytest.mark.parametrize("flag,onednn,preloaded", [("--malloc=tcmalloc", "1", True), ("", "0", True), ("", "1", False)],
                         ids=["tcmalloc", "auto-eigen", "auto-onednn"])
def test_a_run_has_the_malloc_its_flag_and_kernels_ask_for(tmp_path, flag, onednn, preloaded):
    """The installed console script starts again with TCMalloc preloaded when asked, and by
    default (auto) where TensorFlow runs its own kernels, not where it runs oneDNN's: the meter
    finds the library serving the process's malloc (dladdr), not merely named in LD_PRELOAD,
    and config.json records the flag."""
    script = os.path.join(os.path.dirname(sys.executable), "tf-multigpu-train")
    done = subprocess.run([script, f"--run_dir={tmp_path / 'run'}", "--strategy=single", "--batch_size=32",
                           "--steps=2", "--noexport", *([flag] if flag else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TF_ENABLE_ONEDNN_OPTS": onednn})
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout   # one run's summary: the first process printed nothing
    measured = json.loads(lines[0])["memory_measured"]
    assert measured["cpu_kernels"] == ("oneDNN" if onednn == "1" else "Eigen"), measured
    if preloaded:
        assert measured["malloc_library"] == os.path.realpath(TCMALLOC), measured
        assert measured["ld_preload"] == TCMALLOC, measured
    else:
        assert os.path.basename(measured["malloc_library"]).startswith("libc."), measured
        assert "ld_preload" not in measured, measured
    assert json.load(open(tmp_path / "run" / "config.json"))["malloc"] == (flag.split("=")[-1] or "auto")


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
