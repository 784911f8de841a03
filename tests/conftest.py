"""Test set-up: 8 logical CPU devices, made before anything initialises TensorFlow.

Every multi-device test runs on these (the first N of them), so the suite needs no GPU.
"""

import json
import os
from importlib.metadata import version as _version

_USER_LEVEL = "TF_CPP_MIN_LOG_LEVEL" in os.environ
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_TEST_DEVICES = 8
_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_TEST_DEVICES)
DEVICES = [d.name for d in tf.config.list_logical_devices("CPU")]
# The commands the tests start see the environment a user has: TensorFlow read the level it
# keeps this process quiet with when it started, and commands choose their own (cli.py).
if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "2" and not _USER_LEVEL:
    del os.environ["TF_CPP_MIN_LOG_LEVEL"]

from tests import launcher  # noqa: E402  (after the log level is the user's: the server's environment)
from tf_multigpu.parallel import dtensor_mesh  # noqa: E402  (after the logical devices exist)

REPO = launcher.REPO


def run_cli(*args, **options):
    """Runs `python -m tf_multigpu.train ARGS` in a process of its own (tests/launcher.py:
    forked from one that imported TensorFlow, unless `fresh=True`); returns CompletedProcess."""
    return launcher.run_module("tf_multigpu.train", *args, **options)


# Which tests share a process under `pytest -n 2 --dist loadgroup` (README: the test command).
# pytest-xdist sends each group's tests, in file order, to one worker, so:
# - tests that build DTensor meshes in this process (marked `in_process_mesh`) run in the order
#   the sequential suite runs them: a second mesh in one process can hang in an order nobody
#   has run (BUILD_NOTES.md, "A second mesh in one process can hang");
# - the tests of a session-scoped fixture share one build of it, and those of a module-scoped
#   one the module's build, instead of each worker training the same runs again.
# A test that names its group itself (`xdist_group`: a cache of worker results) keeps it.
IN_PROCESS_MESH_GROUP = "in_process_mesh"


@pytest.hookimpl(tryfirst=True)   # before xdist reads the groups in its own hook
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("in_process_mesh"):
            item.add_marker(pytest.mark.xdist_group(IN_PROCESS_MESH_GROUP))
            continue
        # (pytest has no public way to ask a test's fixtures for their scope)
        fixtures = getattr(item, "_fixtureinfo", None)
        ours = {name: defs[-1].scope for name, defs in (fixtures.name2fixturedefs.items() if fixtures else ())
                if defs[-1].func.__module__.startswith("tests.")}   # not pytest's own
        session = sorted(name for name, scope in ours.items() if scope == "session")
        if session:
            item.add_marker(pytest.mark.xdist_group("fixture:" + "+".join(session)))
        elif "module" in ours.values():
            item.add_marker(pytest.mark.xdist_group("module:" + item.module.__name__))


def pytest_configure(config):
    """pytest 9.2 keeps a test's id where pytest-xdist 3.8 does not write its group (pytest-xdist
    issue #1386): `--dist loadgroup` would hand the tests out ungrouped, which can hang."""
    from packaging.version import Version
    if (config.getoption("dist", "no") == "loadgroup" and Version(pytest.__version__) >= Version("9.2")
            and Version(_version("pytest-xdist")) <= Version("3.8.0")):
        raise pytest.UsageError(f"pytest-xdist {_version('pytest-xdist')} does not group tests on pytest "
                                f"{pytest.__version__} (pytest-xdist issue #1386): pip install 'pytest<9.2' "
                                "(as pip install -e '.[test]' does), or run the tests without -n")


def pytest_sessionfinish(session, exitstatus):
    launcher.stop_server()


@pytest.fixture(autouse=True)
def _gather_lowering_as_the_user_left_it():
    """A DTensorParallelism made in this process chooses DTensor's all-gather lowering for its
    mesh through the environment (parallel/dtensor_mesh.py); the next test, and the commands
    it starts, begin from the user's environment again."""
    yield
    dtensor_mesh.restore_gather_lowering()


@pytest.fixture
def devices():
    return DEVICES


@pytest.fixture(scope="module")
def digits_batch():
    """(source, preprocessed images, labels): one batch of 64 digits, the parity tests' batch."""
    from tests.helpers import load_digits_batch
    return load_digits_batch()


@pytest.fixture(scope="session")
def default_run(tmp_path_factory):
    """The README's default command (`--run_dir` alone: data parallel on 2 logical CPU devices,
    15 epochs of digits), run once: (run directory, CompletedProcess, its JSON summary).

    test_cli checks it as the quick start; the bfloat16/XLA and hybrid training tests take it
    as their float32 data-parallel reference instead of training the same run again."""
    run_dir = str(tmp_path_factory.mktemp("default_run") / "quickstart")
    done = run_cli(f"--run_dir={run_dir}", timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def profiled_runs(tmp_path_factory):
    """small_convnet on digits, global batch 64, 5 steps, steps 3-4 profiled (`--profile_steps`),
    under each strategy the communication tests check, and data x2 once unprofiled: name -> run
    directory. test_profiling checks their reports against the model, test_planner the bytes
    against the planner's prediction; one run each serves both."""
    root = tmp_path_factory.mktemp("profiled")

    def train(name, *flags):
        run_dir = str(root / name)
        done = run_cli(f"--run_dir={run_dir}", "--batch_size=64", "--steps=5", "--log_every=5", "--noexport", *flags)
        assert done.returncode == 0, done.stderr[-3000:]
        return run_dir

    profile = "--profile_steps=3,4"
    return {
        "data2": train("data2", "--strategy=data", "--cpu_devices=2", profile),
        "data4": train("data4", "--strategy=data", "--cpu_devices=4", profile),
        "data4_star": train("data4_star", "--strategy=data", "--cpu_devices=4", "--all_reduce=one_device", profile),
        "data2_float16": train("data2_float16", "--strategy=data", "--cpu_devices=2", "--dtype=float16", profile),
        "model2": train("model2", "--strategy=model", "--cpu_devices=2", profile),
        "hybrid4": train("hybrid4", "--strategy=hybrid", "--cpu_devices=4", "--mesh=batch:2,model:2", profile),
        "trick4": train("trick4", "--strategy=model", "--layout=conv_data_fc_model", "--cpu_devices=4", profile),
        "single": train("single", "--strategy=single", profile),
        "data2_plain": train("data2_plain", "--strategy=data", "--cpu_devices=2"),
    }
