"""Input throughput: the pipeline timed alone, the once-only "input cannot keep up" line, and
tools/input_throughput.py's table."""


import pytest

from tests.launcher import run_module
from tf_multigpu.data import load_source, pipeline
from tf_multigpu.data.pipeline import train_dataset
from tf_multigpu.data.throughput import HEADROOM, InputCheck


def _check(share=1.0):
    digits = load_source("digits")
    return InputCheck(lambda: train_dataset(digits, seed=0, global_batch=64, batch_size=64), share=share)


def test_input_bound_training_is_said_once_and_only_then():
    check = _check()
    assert check.rate > 0
    assert check.verdict(check.rate / (2 * HEADROOM)) is None        # the pipeline has room to spare
    line = check.verdict(check.rate)                                  # training takes all it makes
    assert line.startswith("input cannot keep up: the pipeline alone makes") and "1.00x headroom" in line
    assert check.verdict(check.rate) is None                          # said once


def test_a_worker_compares_its_own_share():
    check = _check(share=0.5)    # one of two workers: it reads half of each global batch
    assert check.verdict(1.5 * check.rate) is None                   # it must supply 0.75x its rate
    assert check.verdict(2 * check.rate) is not None


@pytest.mark.slow
def test_tool_prints_the_table():
    done = run_module("tools.input_throughput", "--sources=digits,synthetic", "--image_size=8",
                      "--batch_size=32", "--seconds=0.2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| digits") or line.startswith("| synthetic")]
    assert len(rows) == 2
    for row in rows:
        pipeline, step, headroom = (float(v) for v in row.strip("| ").split("|")[3:6])
        assert pipeline > 0 and step > 0 and abs(headroom - pipeline / step) < 0.01 + 0.02 * headroom


def test_input_threads_give_the_pipelines_their_own_pool():
    digits = load_source("digits", input_threads=5)
    train = train_dataset(digits, seed=0, global_batch=64, batch_size=64)
    assert train.options().threading.private_threadpool_size == 5
    options = pipeline.test_dataset(digits, global_batch=64, batch_size=64).options()
    assert options.threading.private_threadpool_size == 5
    default = train_dataset(load_source("digits"), seed=0, global_batch=64, batch_size=64)
    assert not default.options().threading.private_threadpool_size
