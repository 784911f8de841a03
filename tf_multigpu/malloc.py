"""Which malloc a training process runs with (`--malloc`), chosen before TensorFlow starts.

Where TensorFlow runs its own (Eigen) CPU kernels -- where oneDNN is off: on CPUs without
AVX-512, or with TF_ENABLE_ONEDNN_OPTS=0 -- every tensor comes from the C library's malloc,
and glibc's keeps what tensors give back in per-thread arenas instead of returning it to the
system. A mesh of logical devices, whose ops run on more threads at once, leaves far more of
it than one device: AlexNet 224/64 on model 1x4 ended with 1.21 GiB free in glibc's arenas
against 0.08 GiB on one device, and peaked at 1.51x one device's RSS where TCMalloc gave 1.11x
(BUILD_NOTES.md, "Twenty-seventh session"). No setting of glibc's gets that without costing
time, and the allocator is fixed when a process starts, so `--malloc=tcmalloc` starts the
process again (the same pid, arguments, interpreter options and environment) with TCMalloc's
library preloaded.

Pure Python, no TensorFlow: `apply` runs before TensorFlow is imported, so the allocator it
preloads serves every tensor.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

from absl import flags

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


def define_flag(default: str = SYSTEM, flag_values=flags.FLAGS) -> None:
    """Defines --malloc, once: tf-multigpu-train's flag, which tools that start training runs
    (tools/memory_table.py) take too, with the same meaning, in whichever order a process
    (the tests) imports them."""
    if "malloc" in flag_values:
        return
    flags.DEFINE_string(
        "malloc", default, "The process's memory allocator: system (the C library's malloc), tcmalloc "
        "(TCMalloc, preloaded: the process starts again with it before TensorFlow does), or a shared "
        "library's path to preload (Linux). Where TensorFlow runs its own CPU kernels (oneDNN off: "
        "summary.json's memory_measured.cpu_kernels says Eigen), glibc's malloc keeps what a mesh's "
        "tensors free and TCMalloc does not: see README, 'Memory'.", flag_values=flag_values)


def check_value(value: str) -> None:
    """Refuses a --malloc that is neither a name we know nor a file (pure; no search)."""
    if value in NAMES or (os.sep in value and os.path.isfile(value)):
        return
    if os.sep in value:
        raise UsageError(f"--malloc={value}: no such file: give the path of an allocator's shared library, "
                         f"or one of {', '.join(NAMES)}")
    raise UsageError(f"--malloc={value} is not one of {', '.join(NAMES)} or a library's path "
                     f"(e.g. --malloc=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2; ./{value} for a file here)")


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


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def malloc_library() -> str | None:
    """The real path of the shared library whose `malloc` this process calls: the one the
    loader's global lookup finds (a preloaded allocator's, else the C library's), named by
    dladdr. None where the platform cannot say."""
    try:
        process = ctypes.CDLL(None)
        dladdr = process.dladdr if hasattr(process, "dladdr") else ctypes.CDLL("libdl.so.2").dladdr
        address = ctypes.cast(process.malloc, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    info = _DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode())


def apply(value: str) -> None:
    """Makes this process run with the malloc `value` names: for `system`, nothing; otherwise,
    unless that library already serves malloc, starts the process again with it preloaded
    (never returns then). UsageError if the library cannot be found, the loader would not make
    it serve malloc, or the command line cannot be started again. Call it before TensorFlow is
    imported, and only from a program's entry point: it replaces the process (a caller's state
    is lost; a test calls the program in a subprocess).
    """
    path = library_path(value)
    if path is None or malloc_library() == os.path.realpath(path):
        return
    if os.environ.get(_REQUESTED) == path:   # we were started again with it, and it does not serve malloc
        raise UsageError(f"--malloc={value}: the loader would not make {path} this process's malloc (a reason "
                         "may be printed above): give the path of an allocator's shared library, or use "
                         "--malloc=system")
    command = _command(value)
    preloaded = os.environ.get("LD_PRELOAD", "")
    os.environ["LD_PRELOAD"] = f"{path}:{preloaded}" if preloaded else path   # first: its malloc wins
    os.environ[_REQUESTED] = path
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *command])


def _command(value: str) -> list[str]:
    """This program's command line for the interpreter: its options (-O, -X dev, -W ...: what
    multiprocessing reproduces, from sys.flags), then `-m MODULE ARGS` where it runs as a
    module (sys.argv[0] is then the module's file), else the script (a console script) and its
    arguments. UsageError for `python -c`, which cannot be started again from sys.argv."""
    options = subprocess._args_from_interpreter_flags()   # private, but what multiprocessing uses
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return [*options, "-m", spec.name, *sys.argv[1:]]
    if not os.path.isfile(sys.argv[0]):
        raise UsageError(f"--malloc={value} starts the program again, and {sys.argv[0]!r} is not a program file: "
                         "run tf-multigpu-train or python -m tf_multigpu.train, or set LD_PRELOAD yourself")
    return [*options, *sys.argv]
