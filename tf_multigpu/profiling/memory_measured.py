"""Memory the runtime measured, to report beside the estimate (parallel/memory.py).

- GPUs: TensorFlow's allocator tracks each device's peak (`get_memory_info`); we reset it
  when the meter starts, so the peak is the run's.
- CPUs: logical CPU devices share one allocator and the host's RAM, so there is no figure
  per device. The process's peak resident set (VmHWM) is the measured total of
  all of them, and its resident set when the meter starts (before the model is built) is the
  baseline: TensorFlow's runtime, the data set, Python. The meter resets the kernel's
  high-water mark when it starts (Linux: `echo 5 > /proc/self/clear_refs`), so a transient
  peak from before -- TensorFlow's import, the data set's decoding -- is not counted as the
  run's; where that is not possible the peak is since the process started, and
  `peak_since` says which. `peak_minus_baseline_bytes` is what
  the model, its training step and its devices added -- the figure to hold against the
  estimate summed over devices. Beside it, the peak of TensorFlow's CPU allocator, which all
  logical CPU devices share (`get_memory_info("CPU:0")`, reset when the meter starts): the
  bytes of tensors alone, without the runtime's and malloc's own overhead. And which CPU
  kernels ran (`cpu_kernels`: oneDNN's, or TensorFlow's own Eigen ones where TensorFlow
  leaves oneDNN off, as on CPUs without AVX-512 or with TF_ENABLE_ONEDNN_OPTS=0): the same
  AlexNet step holds measurably different memory with each (BUILD_NOTES.md, "Fifteenth
  session"), so a table is compared only with one of the same kernels. And, where the C
  library is glibc, the bytes its malloc holds free when training ends
  (`malloc_free_bytes`): memory that tensors used and gave back, which glibc keeps in its
  per-thread arenas for reuse instead of returning it to the system, mostly resident.
  With TensorFlow's own kernels, whose tensors come from malloc, a mesh of logical devices
  leaves far more of it than one device (AlexNet 224 at batch 64, model 1x4: 1.48 GiB
  against 0.09; BUILD_NOTES.md, "Eighteenth session"): part of its peak RSS that no tensor
  holds.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys

import tensorflow as tf

from tf_multigpu.malloc import PACKAGES, malloc_library


def rss_bytes() -> int:
    """The process's current resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size since it started, or since the last
    `reset_peak_rss()`.

    Linux: VmHWM of /proc/self/status, the address space's high-water mark: the very mark
    the reset sets back, read directly (getrusage's ru_maxrss is derived from it and from
    other bookkeeping). The mark is updated lazily, so it can lag the current RSS by a few
    pages; the larger of the two is the peak."""
    try:
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):   # no /proc (macOS): since the start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        hwm = peak if sys.platform == "darwin" else peak * 1024   # Linux: KiB, macOS: bytes
    return max(hwm, rss_bytes())


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0: writing 5
    to /proc/self/clear_refs). False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc >= 2.33): every field a size_t."""
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its arenas (mallinfo2's `fordblks`): freed memory it
    keeps for reuse rather than returning it to the system. Most of it is resident (it also
    counts the top of each heap, which may never have been touched: `malloc_trim(0)` gave
    back 1.05 GiB of AlexNet model 1x4's 1.48; nothing in a run calls it, and calling it
    between steps did not lower the peak, which is within a step: BUILD_NOTES.md, "Eighteenth
    session"). None where the C library has no mallinfo2 (macOS, musl, glibc before 2.33).
    An allocator put in front of glibc's (LD_PRELOAD of tcmalloc or jemalloc) leaves glibc's
    arenas nearly empty, and this near 0: its own free memory is not counted."""
    try:   # glibc's own symbol: a preloaded allocator's would win a process-wide lookup
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return int(mallinfo2().fordblks)


def malloc_advice(measured: dict) -> str | None:
    """A one-line hint where TensorFlow's own (Eigen) CPU kernels ran on glibc's malloc and it
    ended the run holding a large share of the peak free (at least a quarter of it, and 256
    MiB): memory in no tensor, that TCMalloc would not keep (`--malloc=tcmalloc`, which
    `--malloc=auto` picks where it is installed; tf_multigpu/malloc.py). None otherwise: with
    oneDNN's kernels TCMalloc saved nothing, and where malloc is another library's
    (`malloc_library`; where that is unknown, anything in LD_PRELOAD), an allocator was
    chosen already."""
    free, peak = measured.get("malloc_free_bytes"), measured.get("peak_rss_bytes", 0)
    library = measured.get("malloc_library")
    chosen = not os.path.basename(library).startswith("libc.") if library else bool(measured.get("ld_preload"))
    if free is None or measured.get("cpu_kernels") != "Eigen" or chosen or free < max(peak / 4, 256 * 2**20):
        return None
    return (f"glibc's malloc held {free / 2**30:.2f} GiB free when training ended, of a {peak / 2**30:.2f} GiB "
            "peak: memory no tensor uses, which it keeps instead of returning it. TCMalloc keeps far less: "
            "--malloc=tcmalloc, which the default picks where TensorFlow runs its own kernels and TCMalloc is "
            f"installed ({PACKAGES}; README, 'Memory')")


def _reset_cpu_allocator_stats() -> bool:
    """Resets the peak of TensorFlow's CPU allocator; False where it keeps no statistics. It
    keeps them with oneDNN on, and none without ("Cannot reset memory stats for device
    'CPU:0'"): with TF_ENABLE_ONEDNN_OPTS=0, and by default on CPUs where TensorFlow leaves
    oneDNN off (TF 2.21 on an AMD EPYC with AVX2 and no AVX-512)."""
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        return True
    except ValueError:
        return False


def cpu_kernels() -> str:
    """"oneDNN" where TensorFlow runs oneDNN's CPU kernels in this process, "Eigen" (its own)
    where not, "unknown" where TensorFlow cannot say (compat.onednn_enabled)."""
    from tf_multigpu.compat import onednn_enabled
    return {True: "oneDNN", False: "Eigen", None: "unknown"}[onednn_enabled()]


class MemoryMeter:
    """Start it before the model is built; `measured()` after training gives the peaks."""

    def __init__(self, devices: list[str]):
        self.gpus = [d.split("device:")[-1] for d in devices if "GPU" in d.split("device:")[-1].upper()]
        for device in self.gpus:
            tf.config.experimental.reset_memory_stats(device)
        self.cpu_stats = not self.gpus and _reset_cpu_allocator_stats()   # only CPUs report it
        self.peak_reset = reset_peak_rss()
        self.baseline = rss_bytes()

    def measured(self) -> dict:
        """GPUs: {"peak_bytes_per_device": {device: bytes}, "max_peak_bytes"}. CPUs: the
        process's {"peak_rss_bytes", "peak_since", "baseline_rss_bytes",
        "peak_minus_baseline_bytes", "cpu_kernels"}, with "tf_allocator_peak_bytes" where the
        allocator keeps statistics, "malloc_free_bytes" (now, at the end of training) where
        the C library is glibc, "ld_preload" where the process runs with libraries
        preloaded (LD_PRELOAD: an allocator such as tcmalloc) and "malloc_library", the library
        whose malloc the process calls (tf_multigpu/malloc.py). Both with "source", what was
        read."""
        if self.gpus:
            peaks = {gpu: int(tf.config.experimental.get_memory_info(gpu)["peak"]) for gpu in self.gpus}
            return {"source": "tf.config.experimental.get_memory_info", "peak_bytes_per_device": peaks,
                    "max_peak_bytes": max(peaks.values())}
        peak = peak_rss_bytes()
        free = malloc_free_bytes()
        preloaded = os.environ.get("LD_PRELOAD", "")   # another malloc (tcmalloc, jemalloc) changes the RSS
        serving = malloc_library()   # what the process really calls (a preload can be refused, or lose)
        return {"source": "process peak RSS (all logical CPU devices)", "peak_rss_bytes": peak,
                "peak_since": "meter start" if self.peak_reset else "process start",
                "baseline_rss_bytes": self.baseline, "peak_minus_baseline_bytes": peak - self.baseline,
                "cpu_kernels": cpu_kernels(),
                **({"tf_allocator_peak_bytes": int(tf.config.experimental.get_memory_info("CPU:0")["peak"])}
                   if self.cpu_stats else {}),
                **({"malloc_free_bytes": free} if free is not None else {}),
                **({"ld_preload": preloaded} if preloaded else {}),
                **({"malloc_library": serving} if serving else {})}

    @staticmethod
    def scalars(measured: dict) -> dict:
        """The numeric entries of `measured()`, flat, for TensorBoard."""
        flat = {k: v for k, v in measured.items() if isinstance(v, int)}
        per_device = measured.get("peak_bytes_per_device", {})
        flat.update({f"{d.replace(':', '_')}_peak_bytes": v for d, v in per_device.items()})
        return flat
