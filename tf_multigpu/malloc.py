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
library preloaded. TCMalloc also made those steps faster (one device: 30% less time).

`--malloc=auto`, the default, does that where TensorFlow will run its Eigen kernels and
TCMalloc is installed, and keeps the system's malloc elsewhere: with oneDNN's kernels (whose
memory oneDNN manages) TCMalloc saved nothing. Which kernels TensorFlow will run is its own
decision (the CPU's features and TF_ENABLE_ONEDNN_OPTS), asked of it in a child process that
loads its small util module only (`tensorflow_runs_onednn`, about 0.4 s), not copied here.

Pure Python, no TensorFlow: `apply` runs before TensorFlow is imported, so the allocator it
preloads serves every tensor.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import subprocess
import sys

from absl import flags

from tf_multigpu.errors import UsageError

AUTO = "auto"
SYSTEM = "system"
TCMALLOC = "tcmalloc"
NAMES = (AUTO, SYSTEM, TCMALLOC)

# gperftools' TCMalloc: the "minimal" library (the allocator without the heap profiler) first.
# Debian and Ubuntu ship it as libtcmalloc-minimal4, Fedora as gperftools-libs.
TCMALLOC_LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
PACKAGES = "Debian/Ubuntu: apt install libtcmalloc-minimal4; Fedora: dnf install gperftools-libs"
INSTALL_HINT = f"install it ({PACKAGES}) or give the library's path, --malloc=/path/to/libtcmalloc_minimal.so.4"
_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib", "/lib/x86_64-linux-gnu", "/lib64", "/lib")
# Set in the process that is started again: the library it asked the loader for.
_REQUESTED = "TF_MULTIGPU_MALLOC_PRELOADED"


def define_flag(default: str = AUTO, flag_values=flags.FLAGS) -> None:
    """Defines --malloc, once: tf-multigpu-train's flag, which tools that start training runs
    (tools/memory_table.py) take too, with the same meaning, in whichever order a process
    (the tests) imports them."""
    if "malloc" in flag_values:
        return
    flags.DEFINE_string(
        "malloc", default, "The process's memory allocator: auto (TCMalloc where TensorFlow will run its "
        "own CPU kernels and TCMalloc is installed, else the system's), system (the C library's malloc), "
        "tcmalloc (TCMalloc, preloaded: the process starts again with it before TensorFlow does), or a "
        "shared library's path to preload (Linux). Where TensorFlow runs its own CPU kernels (oneDNN off: "
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
    """The shared library `value` asks for (None for `system`; for `auto`, see `auto_choice`).
    UsageError where TCMalloc is not installed, or on a system whose loader has no LD_PRELOAD."""
    if value == SYSTEM:
        return None
    if value == AUTO:
        return auto_choice()[0]
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


def tensorflow_runs_onednn() -> bool | None:
    """Whether TensorFlow, started in this process's environment, will run oneDNN's CPU
    kernels: TensorFlow's own answer (`IsMklEnabled`, what compat.onednn_enabled reads once it
    runs), asked before it starts, of a child process that loads only the small extension
    module holding it, not TensorFlow. None where that cannot be asked (no TensorFlow, another
    layout of its files, a child that fails)."""
    try:
        spec = importlib.util.find_spec("tensorflow")   # finds the package without importing it
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    util = os.path.join(list(spec.submodule_search_locations)[0], "python", "util")
    candidates = [os.path.join(util, "_pywrap_util_port" + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    found = [path for path in candidates if os.path.isfile(path)]
    if not found:
        return None
    try:
        done = subprocess.run([sys.executable, "-c", _ASK_ONEDNN, found[0]], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return {"1": True, "0": False}.get(answer[0]) if answer else None


_ASK_ONEDNN = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("_pywrap_util_port", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(int(module.IsMklEnabled()))"""


def auto_choice() -> tuple[str | None, str]:
    """What `--malloc=auto` preloads, and why: (TCMalloc's path, reason) where TensorFlow will
    run its own (Eigen) CPU kernels on glibc's malloc, TCMalloc is installed and the process
    can be started again; otherwise (None, reason), and the process keeps the malloc it has.
    Never an error: nobody asked for an allocator."""
    if not sys.platform.startswith("linux"):
        return None, "the system's (preloading works on Linux only)"
    serving, requested = malloc_library(), os.environ.get(_REQUESTED)
    if serving is None:
        return None, "the system's (the process cannot tell which library serves malloc)"
    if requested and serving == os.path.realpath(requested):   # started again by apply: done
        return requested, _WHY_TCMALLOC.format(requested)
    if not os.path.basename(serving).startswith("libc."):
        return None, f"{serving}, which serves malloc already"
    if requested:
        return None, f"glibc's: the loader would not preload {requested} (its reason may be printed above)"
    try:   # the cheap checks first: the question to TensorFlow takes a child process
        _command(AUTO)
    except UsageError:
        return None, f"glibc's ({sys.argv[0]!r} cannot be started again with another malloc)"
    try:
        path = library_path(TCMALLOC)
    except UsageError:
        return None, ("glibc's (TCMalloc, which keeps far less where TensorFlow runs its own CPU kernels, is not "
                      f"installed: {PACKAGES})")
    onednn = tensorflow_runs_onednn()
    if onednn is None:
        return None, "glibc's (TensorFlow could not say which CPU kernels it will run)"
    if onednn:
        return None, "glibc's (TensorFlow runs oneDNN's CPU kernels here, where TCMalloc saves nothing)"
    return path, _WHY_TCMALLOC.format(path)


_WHY_TCMALLOC = ("TCMalloc ({}): TensorFlow runs its own CPU kernels here, and glibc's malloc keeps what their "
                 "tensors free")


def apply(value: str) -> str:
    """Makes this process run with the malloc `value` names: for `system`, nothing; for `auto`,
    what `auto_choice` says; otherwise, unless that library already serves malloc, starts the
    process again with it preloaded (never returns then). Returns a line saying which malloc
    the process runs with, for the log. UsageError (never for `auto`) if the library cannot be
    found, the loader would not make it serve malloc, or the command line cannot be started
    again. Call it before TensorFlow is imported, and only from a program's entry point: it
    replaces the process (a caller's state is lost; a test calls the program in a subprocess).
    """
    if value == AUTO:
        path, why = auto_choice()
        if path is None:
            return f"malloc: {why} (--malloc=auto)"
    else:
        path = why = library_path(value)
        if path is None:
            # the library that serves malloc: the C library's, or one preloaded outside tf_multigpu
            serving = malloc_library() or "the system's"
            return f"malloc: {serving} (--malloc=system)"
    if malloc_library() == os.path.realpath(path):
        return f"malloc: {why} (--malloc={value})"
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
