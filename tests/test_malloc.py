"""--malloc: a training process started again with TCMalloc (or another allocator) preloaded,
before TensorFlow starts, and the hint a run gives where glibc's malloc kept much of its peak.

CI installs Debian's libtcmalloc-minimal4 (.ci/run), as the README tells a user to."""

import json
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

GIB = 2**30


def test_malloc_values_are_checked(tmp_path):
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


def test_tcmalloc_is_found_or_its_package_named(monkeypatch, tmp_path):
    assert malloc.library_path("system") is None
    found = malloc.library_path("tcmalloc")   # CI installs it
    assert os.path.basename(found) in malloc.TCMALLOC_LIBRARIES and os.path.isfile(found)
    monkeypatch.setattr(malloc, "_LIBRARY_DIRS", (str(tmp_path),))
    with pytest.raises(UsageError, match=r"--malloc=tcmalloc: TCMalloc's library .* is not installed: "
                                         r"install it \(Debian/Ubuntu: apt install libtcmalloc-minimal4"):
        malloc.library_path("tcmalloc")


def _summary(done):
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout   # one run's summary: the first process printed nothing
    return json.loads(lines[0])


@pytest.mark.slow
def test_a_run_with_tcmalloc_runs_under_it(tmp_path):
    """The installed console script starts again with TCMalloc preloaded: the summary's meter
    names it, and glibc's arenas, which tensors no longer use, hold next to nothing. (`python
    -m` starts again as `-m tf_multigpu.train`: the test below.)"""
    script = os.path.join(os.path.dirname(sys.executable), "tf-multigpu-train")
    done = subprocess.run([script, f"--run_dir={tmp_path / 'run'}", "--strategy=single", "--batch_size=32",
                           "--steps=2", "--noexport", "--malloc=tcmalloc"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    measured = _summary(done)["memory_measured"]
    assert measured["ld_preload"] == malloc.library_path("tcmalloc"), measured
    assert measured["malloc_free_bytes"] < 64 * 2**20, measured
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
    assert last.startswith(f"tf-multigpu-train: error: --malloc={bogus}: the loader would not preload {bogus}"), last
    assert "cannot be preloaded" in done.stderr   # ld.so's own reason, above it
    assert not (tmp_path / "run").exists()


def test_advice_where_glibc_kept_much_of_the_peak():
    kept = {"peak_rss_bytes": 3 * GIB, "malloc_free_bytes": int(1.48 * GIB)}   # AlexNet model 1x4, Eigen
    assert malloc_advice(kept).startswith("glibc's malloc held 1.48 GiB free when training ended, of a 3.00 GiB peak")
    assert "--malloc=tcmalloc" in malloc_advice(kept)
    assert malloc_advice({**kept, "ld_preload": "/usr/lib/libtcmalloc_minimal.so.4"}) is None
    assert malloc_advice({"peak_rss_bytes": 3 * GIB, "malloc_free_bytes": int(0.09 * GIB)}) is None   # one device
    assert malloc_advice({"peak_rss_bytes": 600 * 2**20, "malloc_free_bytes": 200 * 2**20}) is None   # small
    assert malloc_advice({"peak_bytes_per_device": {}}) is None   # GPUs
