"""Which malloc a training process runs with (`--malloc`), chosen before TensorFlow starts.

Where TensorFlow runs its own (Eigen) CPU kernels -- on CPUs without AVX-512, or with
TF_ENABLE_ONEDNN_OPTS=0 -- every tensor comes from the C library's malloc, and glibc's keeps
what tensors give back in per-thread arenas instead of returning it to the system. A mesh of
logical devices, whose ops run on more threads at once, leaves far more of it than one
device: AlexNet 224/64 on model 1x4 ended with 1.48 GiB free in glibc's arenas against 0.09
GiB on one device, and peaked at 1.50x one device's RSS where TCMalloc gave 1.05x and a
30% shorter step on one device (BUILD_NOTES.md, "Eighteenth session"). No setting of glibc's
gets that without costing time, and the allocator is fixed when a process starts, so
`--malloc=tcmalloc` starts the process again (the same pid, arguments and environment) with
TCMalloc's library preloaded.

Pure Python, no TensorFlow: `apply` runs before TensorFlow is imported, so the allocator it
preloads serves every tensor.
"""

from __future__ import annotations

import os
import sys

from tf_multigpu.errors import UsageError

SYSTEM = "system"
TCMALLOC = "tcmalloc"
NAMES = (SYSTEM, TCMALLOC)

# gperftools' TCMalloc: the "minimal" library (the allocator without the heap profiler) first.
# Debian and Ubuntu ship it as libtcmalloc-minimal4, Fedora as gperftools-libs.
TCMALLOC_LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
INSTALL_HINT = ("install it (Debian/Ubuntu: apt install libtcmalloc-minimal4; Fedora: dnf install "
                "gperftools-libs) or give the library's path, --malloc=/path/to/libtcmalloc_minimal.so.4")
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64", "/lib")
# Set in the process that is started again: the library it asked the loader for.
_REQUESTED = "TF_MULTIGPU_MALLOC_PRELOADED"


def check_value(value: str) -> None:
    """Refuses a --malloc that is neither a name we know nor a file (pure; no search)."""
    if value in NAMES or (os.sep in value and os.path.isfile(value)):
        return
    if os.sep in value:
        raise UsageError(f"--malloc={value}: no such file: give the path of an allocator's shared library, "
                         f"or one of {', '.join(NAMES)}")
    raise UsageError(f"--malloc={value} is not one of {', '.join(NAMES)} or a library's path "
                     "(e.g. --malloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2)")


def library_path(value: str) -> str | None:
    """The shared library `value` asks for (None for `system`). UsageError where TCMalloc is
    not installed, or on a system whose loader has no LD_PRELOAD."""
    if value == SYSTEM:
        return None
    if not sys.platform.startswith("linux"):
        raise UsageError(f"--malloc={value} works on Linux only (it preloads the library with LD_PRELOAD): "
                         "use --malloc=system")
    if value != TCMALLOC:
        return os.path.abspath(value)
    for directory in _LIBRARY_DIRS:
        for name in TCMALLOC_LIBRARIES:
            if os.path.isfile(os.path.join(directory, name)):
                return os.path.join(directory, name)
    raise UsageError(f"--malloc=tcmalloc: TCMalloc's library ({' or '.join(TCMALLOC_LIBRARIES)}) is not "
                     f"installed: {INSTALL_HINT}, or use --malloc=system")


def loaded(path: str) -> bool:
    """Whether the shared library at `path` is mapped into this process."""
    real = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            return any(line.rstrip().endswith(real) for line in f)
    except OSError:
        return False


def apply(value: str) -> None:
    """Makes this process run with the malloc `value` names: for `system`, nothing; otherwise,
    unless the library is already loaded, starts the process again with it preloaded (never
    returns then). UsageError if the library cannot be found or the loader would not preload
    it. Call it before TensorFlow is imported, and only from a program's entry point: it
    replaces the process (a caller's state is lost; a test calls the program in a subprocess).
    """
    path = library_path(value)
    if path is None or loaded(path):
        return
    if os.environ.get(_REQUESTED) == path:   # we were started again with it, and the loader refused it
        raise UsageError(f"--malloc={value}: the loader would not preload {path} (it printed why above): give "
                         "the path of an allocator's shared library, or use --malloc=system")
    preloaded = os.environ.get("LD_PRELOAD", "")
    os.environ["LD_PRELOAD"] = f"{path}:{preloaded}" if preloaded else path
    os.environ[_REQUESTED] = path
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *_command()])


def _command() -> list[str]:
    """This program's command line, for the interpreter: `-m MODULE ARGS` where it runs as a
    module (sys.argv[0] is then the module's file), else the script (a console script) and
    its arguments."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return ["-m", spec.name, *sys.argv[1:]]
    return sys.argv
