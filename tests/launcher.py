"""The commands the tests run (`python -m MODULE ARGS`), each in a process of its own, forked
from a server that has already imported TensorFlow (tests/conftest.run_cli and the tests that
run a tool, the planner, the export or a worker).

Every command a test starts pays Python's import of TensorFlow, Keras and scikit-learn before
it does anything: about 5 s on CI's 2 cores, times over a hundred commands. The server
(`_SERVER`, one per test session) imports them once and lists the physical devices, as
`cli.start_tensorflow` does, without starting TensorFlow's runtime (no logical device, no
context), and forks a child per command. The child is a process like any other: it sets its
own devices, environment, working directory, arguments and random seeds, runs the module as
`python -m` would (or the code as `python -c` would, in a `__main__` of its own), and exits
with the status a fresh process would have. What it skips is the import itself, and with it
TensorFlow's start-up log lines.

What a fork cannot give a command runs fresh: a command whose environment changes a variable
read when the interpreter or TensorFlow starts (`_READ_AT_START`), or `fresh=True`. Tests whose
subject is the start itself call subprocess directly: the quiet start-up log, commands that
must exit before TensorFlow is imported, a fresh process's peak memory, import hygiene, a
client that must import nothing but TensorFlow, and worker processes that signal each other.
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The server's environment: this process's when the tests start (conftest has removed the log
# level it set for itself), not whatever a test has patched in by the first command.
_SERVER_ENV = dict(os.environ)
# Read when the interpreter, NumPy's BLAS, TensorFlow or Keras start: a command whose value
# differs from the server's gets a fresh process.
_READ_AT_START = ("TF_CPP_MIN_LOG_LEVEL", "TF_CPP_VMODULE", "TF_CPP_MAX_VLOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS",
                  "CUDA_VISIBLE_DEVICES", "KERAS_BACKEND", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                  "PYTHONPATH", "PYTHONHASHSEED")

_SERVER = r"""
import json, os, random, sys, types
# The start a command makes by default: cli.configure_logging's level unless the user set one,
# TensorFlow's start-up lines off the console (cli.start_tensorflow holds them back likewise).
_user_level = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
_stderr, _null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 2)
os.close(_null)
import numpy, tensorflow, keras, sklearn.datasets, absl.app, absl.flags  # noqa: F401
tensorflow.config.list_physical_devices()   # as cli.start_tensorflow does, still configurable
os.dup2(_stderr, 2)
os.close(_stderr)
if _user_level is None:
    del os.environ["TF_CPP_MIN_LOG_LEVEL"]
import runpy


def child(request):
    os.setsid()   # its own process group: a timeout kills the runs it starts too
    random.seed()
    numpy.random.seed()   # a fresh process's seeds, not the server's state
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, mode)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "code" in request:   # python -c CODE ARGS, in a __main__ of its own
        sys.argv = ["-c", *request["args"]]
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        return
    sys.path[0] = request["cwd"]   # as `python -m` sets it
    sys.argv = [request["module"], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
        sys.exit(0)   # the module returned: exit as `python -m` does (atexit handlers run)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
"""

_server = None


def _started_server():
    global _server
    if _server is None or _server.poll() is not None:
        log = tempfile.NamedTemporaryFile(prefix="launcher-", suffix=".log", delete=False)
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], cwd=REPO, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=log, bufsize=0, env=_SERVER_ENV)
        _server.pending, _server.log = b"", log.name
    return _server


def _reply(server, timeout=None):
    """The server's next line (a JSON object), or None if none came within `timeout` s."""
    while b"\n" not in server.pending:
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        if not ready:
            return None
        chunk = os.read(server.stdout.fileno(), 4096)
        if not chunk:
            raise RuntimeError(f"the test launcher's server died; its stderr ({server.log}) ends: "
                               + open(server.log, errors="backslashreplace").read()[-2000:])
        server.pending += chunk
    line, server.pending = server.pending.split(b"\n", 1)
    return json.loads(line)


def stop_server():
    """Ends the server (it exits when its input closes): the end of the test session."""
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait(timeout=60)
        os.remove(_server.log)
        _server = None


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:   # it ended meanwhile
        pass


def _drop_server():
    """Kills the server after a request went wrong midway: its next reply would be out of step."""
    global _server
    _server.kill()
    _server.wait()
    _server = None


def run_module(module, *args, **options):
    """`python -m MODULE ARGS` run to its end, as subprocess.run(capture_output=True, text=True)
    would: a CompletedProcess (TimeoutExpired after `timeout` s, the command killed). Forked
    from the server unless `fresh`, or `env` changes a variable read at start (`_READ_AT_START`)."""
    return _run({"module": module}, ["-m", module], args, **options)


def run_code(code, *args, **options):
    """`python -c CODE ARGS`, as run_module runs a module."""
    return _run({"code": code}, ["-c", code], args, **options)


def _run(what, command, args, timeout=300, env=None, cwd=REPO, fresh=False):
    env = {**os.environ, **(env or {})}
    argv = [sys.executable, *command, *args]
    if fresh or any(env.get(name) != _SERVER_ENV.get(name) for name in _READ_AT_START):
        return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    server = _started_server()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        request = {**what, "args": list(args), "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
        pid = None
        try:
            server.stdin.write((json.dumps(request) + "\n").encode())
            pid = _reply(server)["pid"]
            done = _reply(server, timeout)
            if done is None:
                _kill_group(pid)   # the command and the runs it started
                _reply(server)
        except BaseException:   # interrupted, or the server failed: nothing of this request may linger
            if pid is not None:
                _kill_group(pid)
            _drop_server()
            raise
        stdout, stderr = (open(path, errors="backslashreplace").read() for path in (out, err))
    if done is None:
        raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(argv, done["status"], stdout, stderr)
