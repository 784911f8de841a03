"""The config: validation with the fix in the message, JSON round trip, resume checks."""

import dataclasses

import pytest

from tf_multigpu.config import Config, check_resumable, load_config
from tf_multigpu.errors import UsageError


def test_defaults_are_valid():
    cfg = Config(run_dir="r").validate()
    assert (cfg.strategy, cfg.dataset, cfg.model) == ("data", "digits", "small_convnet")


@pytest.mark.parametrize("change, needle", [
    ({"strategy": "pipeline"}, "choose one of single, data"),
    ({"learning_rate": -0.1}, "--learning_rate=-0.1 must be > 0"),
    ({"learning_rate": 0.0}, "must be > 0"),
    ({"momentum": 1.5}, "--momentum=1.5 must be in [0, 1)"),
    ({"weight_decay": -1.0}, "--weight_decay"),
    ({"batch_size": 0}, "--batch_size=0 must be >= 1"),
    ({"steps": -3}, "--steps=-3 must be >= 0"),
    ({"all_reduce": "magic"}, "choose one of auto, nccl"),
    ({"lr_schedule": "linear"}, "choose one of constant, step, cosine"),
    ({"run_dir": ""}, "--run_dir is required"),
    ({"strategy": "single", "num_devices": 2}, "use --strategy=data"),
    ({"layout": "fc_only"}, "--layout applies to --strategy=model or hybrid"),
    ({"strategy": "hybrid", "layout": "conv_data_fc_model"}, "which DTensor cannot shard: use --strategy=model"),
    ({"strategy": "hybrid", "all_reduce": "one_device"}, "--all_reduce applies to --strategy=data"),
    ({"mesh": "batch:2,model:1"}, "--mesh applies to --strategy=model or hybrid"),
    ({"data_dir": "/nonexistent/tfds"}, "--data_dir=/nonexistent/tfds is not a readable directory"),
    ({"augment": "heavy"}, "unknown --augment='heavy': choose one of auto, none, paper"),
    ({"test_fraction": 1.0}, "--test_fraction=1.0 must be between 0 and 1"),
    ({"dataset": "folder:"}, "--dataset=folder: needs the folder"),
    ({"input_threads": -1}, "--input_threads=-1 must be >= 0"),

    ({"batchnorm": "local"}, "unknown --batchnorm='local': choose one of sync, per_replica"),
    ({"strategy": "hybrid", "batchnorm": "per_replica"}, "--batchnorm=per_replica applies to --strategy=data"),
])
def test_bad_values_name_the_fix(change, needle):
    with pytest.raises(UsageError) as e:
        dataclasses.replace(Config(run_dir="r"), **change).validate()
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_global_batch_must_divide_by_replicas():
    cfg = Config(run_dir="r", batch_size=30)
    cfg.check_devices(3)
    with pytest.raises(UsageError,
                       match=r"does not divide by the 4 replicas: use a multiple of 4, e.g. --batch_size=28"):
        cfg.check_devices(4)


def test_json_round_trip(tmp_path):
    cfg = Config(run_dir=str(tmp_path), strategy="single", steps=7, data_dir=None, learning_rate=0.3)
    cfg.write(tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == cfg


def test_resume_refuses_other_results_but_allows_more_steps_or_devices():
    old = Config(run_dir="r", steps=10)
    check_resumable(old, dataclasses.replace(old, steps=20, strategy="single", num_devices=1))
    with pytest.raises(UsageError, match=r"--batch_size: 64 -> 128.*use a new --run_dir"):
        check_resumable(old, dataclasses.replace(old, batch_size=128))
