"""What every command-line program of the package shares (tf-multigpu-train/plan/export and
the tools under tools/).

- Bad input is one line on stderr (`PROG: error: ...`) and exit status 2, absl's own flag
  errors included (absl would exit 1 with a multi-line message); a run that does not fit the
  device memory exits 3 (`DOES_NOT_FIT`), so a batch-size search can tell the two apart.
- A quiet start: TensorFlow's C++ start-up logging (oneDNN, "Could not find cuda drivers",
  "failed call to cuInit" on a machine without a GPU, twice over) stays off the console.
  TensorFlow writes part of it before its log level applies, so `TF_CPP_MIN_LOG_LEVEL` alone
  cannot hide it: `start_tensorflow` imports TensorFlow and finds the devices with the
  process's stderr held, then passes on what the level lets through. `--verbose`, or a
  `TF_CPP_MIN_LOG_LEVEL` the user set, brings the logging back.

This module must not import TensorFlow: entry points import it first, and TensorFlow reads
its log level when it is imported.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
import tempfile

from absl import flags

from tf_multigpu.errors import DoesNotFit, UsageError

USAGE_ERROR = 2
DOES_NOT_FIT = 3   # out of device memory: tools/max_batch.py's search reads it

flags.DEFINE_bool("verbose", False, "Show TensorFlow's start-up and C++ logging and INFO diagnostics "
                  "(default: only warnings and errors).")

_QUIET_LEVEL = "2"   # TensorFlow's C++ log level by default: errors only
# absl's C++ log lines: severity letter, then MMDD (0000 before absl's logging is initialised).
_CPP_LOG = re.compile(r"^([IWEF])\d{4} ")
_SEVERITY = "IWEF"
_OURS = "TF_MULTIGPU_QUIET"   # "1": TF_CPP_MIN_LOG_LEVEL is our default, not the user's
_HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "--helpfull", "--helpxml")   # absl's
_PRE_INIT_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def refuse_earlier_results(flag: str, directory: str, names) -> None:
    """Refuses an output directory a tool would write `names` into where one of them exists
    already: running a tool again into the same directory replaced an earlier run's tables,
    plots and runs without a word (UsageError, one line)."""
    if os.path.isfile(directory):
        raise UsageError(f"{flag}={directory} is a file: give a directory")
    found = [name for name in names if os.path.exists(os.path.join(directory, name))]
    if found:
        raise UsageError(f"{flag}={directory} holds an earlier run's results ({', '.join(found)}): give a new "
                         f"{flag}, or move them out first")


def fail(prog: str, message: str, status: int = USAGE_ERROR):
    """Prints `prog: error: message` and exits with `status`."""
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def run(main, prog: str, flag_names=()) -> None:
    """`absl.app.run(main)` with one-line flag errors, `--verbose`, and `--help` listing
    `flag_names` (and --verbose).

    absl's --help lists the flags of the module sys.argv[0] names: for a console script
    that is the installed wrapper, which defines none, so ours are listed under it too."""
    from absl import app
    for name in (*flag_names, "verbose"):
        flags.FLAGS.register_flag_by_module(sys.argv[0], flags.FLAGS[name])

    def main_with_logging(argv):
        configure_logging(flags.FLAGS.verbose)
        try:
            return main(argv)
        except UsageError as e:   # a tool's bad input, found past its own checks: one line, not a trace
            fail(prog, str(e), DOES_NOT_FIT if isinstance(e, DoesNotFit) else USAGE_ERROR)

    try:
        app.run(main_with_logging, flags_parser=flags_parser(prog))
    except SystemExit as e:
        # absl exits 1 after printing the help it was asked for; asking is not a failure.
        if e.code == 1 and any(arg.split("=")[0] in _HELP_FLAGS for arg in sys.argv[1:]):
            sys.exit(0)
        raise


# Flags that name files or directories: a leading ~ is the user's home, as a shell would
# have made it had the value not followed "--flag=" (bash expands ~ only at a word's start).
PATH_FLAGS = ("run_dir", "data_dir", "export_dir", "checkpoint", "out_dir", "profile", "folder", "out", "malloc")


def flags_parser(prog: str):
    """A `flags_parser` for `absl.app.run`: absl's parser, with a bad flag as a usage error,
    and ~ expanded in the path flags (`--dataset=folder:~/...` too)."""

    def parse(argv):
        try:
            argv = flags.FLAGS(argv)
        except flags.Error as e:
            message = str(e).removeprefix("ERROR:: ").strip()
            if "Unable to open flagfile" in message:
                fail(prog, f"{message}: a --flagfile path (also one inside a flagfile) is relative to the "
                           "current directory: run from the repository root, or give an absolute path")
            fail(prog, f"{message} (see --help)")
        for name in PATH_FLAGS:
            if name in flags.FLAGS and isinstance(flags.FLAGS[name].value, str):
                setattr(flags.FLAGS, name, os.path.expanduser(flags.FLAGS[name].value))
        if "dataset" in flags.FLAGS and str(flags.FLAGS.dataset).startswith("folder:~"):
            flags.FLAGS.dataset = "folder:" + os.path.expanduser(flags.FLAGS.dataset[len("folder:"):])
        return argv

    return parse


def configure_logging(verbose: bool) -> None:
    """Our diagnostics through absl logging at WARNING (INFO with --verbose), and TensorFlow's
    C++ log level, unless the user set `TF_CPP_MIN_LOG_LEVEL`. Before TensorFlow is imported."""
    from absl import logging
    logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    if "TF_CPP_MIN_LOG_LEVEL" not in os.environ:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if verbose else _QUIET_LEVEL
        os.environ[_OURS] = "" if verbose else "1"   # child processes tell ours from the user's


def start_tensorflow():
    """Imports TensorFlow and lists the physical devices (which initialises CUDA, or fails to),
    keeping the start-up logging the log level should hide off the console. Returns `tf`.

    Call it where a command first needs TensorFlow; a process that already imported it (a
    test, a notebook) is left alone. Listing the physical devices leaves them configurable
    (logical devices, memory limits, the multi-worker runtime are set up afterwards).
    """
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    verbose = flags.FLAGS.is_parsed() and flags.FLAGS.verbose
    if verbose:
        import tensorflow as tf
        tf.config.list_physical_devices()
        return tf
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", _QUIET_LEVEL)
    level = int(level) if level.isdigit() else 0
    ours = os.environ.get(_OURS) == "1" or "TF_CPP_MIN_LOG_LEVEL" not in os.environ
    with _stderr_filtered(lambda line: _shown(line, level, ours)):
        import tensorflow as tf
        tf.config.list_physical_devices()
    return tf


def _shown(line: str, level: int, ours: bool) -> bool:
    """Whether a start-up stderr line should reach the user at TF_CPP_MIN_LOG_LEVEL=`level`.

    TensorFlow prints its first lines before that level applies; here it does. At our own
    default level, cuInit failing on a machine without an NVIDIA device is how TensorFlow
    finds out there is no GPU, not an error (with a device, it stays: the driver is broken).
    """
    if line.strip() == _PRE_INIT_BANNER:
        return level == 0
    found = _CPP_LOG.match(line)
    if not found:
        return True
    if _SEVERITY.index(found.group(1)) < level:
        return False
    return not (ours and "failed call to cuInit" in line and not nvidia_device_present())


def nvidia_device_present() -> bool:
    """Whether this machine shows an NVIDIA GPU, without starting TensorFlow: a device node
    (any /dev/nvidiaN: a container may expose only some), the driver's /proc entry, or WSL2's
    GPU paravirtualisation device (/dev/dxg)."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/dxg"))


@contextlib.contextmanager
def _stderr_filtered(keep):
    """Holds everything written to file descriptor 2 (C++ and Python alike) and, on exit,
    writes back the lines `keep` accepts. Continuation lines go with the line they continue."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            shown = True
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                starts_record = bool(_CPP_LOG.match(line)) or line.strip() == _PRE_INIT_BANNER
                if starts_record or not _continues(line):
                    shown = keep(line)
                if shown:
                    sys.stderr.write(line)
            sys.stderr.flush()


def _continues(line: str) -> bool:
    """A line that continues the previous log record (TensorFlow wraps some messages)."""
    return line.startswith(("To enable the following instructions", " ", "\t"))
