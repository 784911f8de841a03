"""The config: validation with the fix in the message (flags alone; on devices and clusters),
JSON round trip, resume checks."""

import dataclasses

import pytest

from tf_multigpu.config import Config, check_plan, check_resumable, load_config
from tf_multigpu.errors import UsageError
from tf_multigpu.parallel.cluster import Cluster

CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]


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
    ({"dataset": "tfds:cifar10", "data_dir": "/nonexistent/tfds"},
     "--data_dir=/nonexistent/tfds is not a readable directory"),
    ({"data_dir": "/tmp"}, "--data_dir applies to --dataset=tfds:NAME, not digits: drop --data_dir"),
    ({"augment": "heavy"}, "unknown --augment='heavy': choose one of auto, none, paper"),
    ({"test_fraction": 1.0}, "--test_fraction=1.0 must be between 0 and 1"),
    ({"dataset": "folder:"}, "--dataset=folder: needs the folder"),
    ({"input_threads": -1}, "--input_threads=-1 must be >= 0"),
    ({"strategy": "data", "shard_optimizer_state": True}, "--strategy=data has one copy of it per device"),
    ({"strategy": "hybrid", "shard_optimizer_state": True, "momentum": 0.0}, "--momentum=0 has none"),

    ({"batchnorm": "local"}, "unknown --batchnorm='local': choose one of sync, per_replica"),
    ({"strategy": "hybrid", "batchnorm": "per_replica"}, "--batchnorm=per_replica applies to --strategy=data"),
])
def test_bad_values_name_the_fix(change, needle):
    with pytest.raises(UsageError) as e:
        dataclasses.replace(Config(run_dir="r"), **change).validate()
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_global_batch_must_divide_by_replicas():
    cfg = Config(batch_size=30)   # check_plan needs no run directory
    check_plan(cfg, CPUS[:3])
    with pytest.raises(UsageError,
                       match=r"does not divide by the 4 replicas: use a multiple of 4, e.g. --batch_size=28"):
        check_plan(cfg, CPUS[:4])
    check_plan(dataclasses.replace(cfg, strategy="hybrid", mesh="batch:3,model:2"), CPUS[:6])
    with pytest.raises(UsageError, match="does not divide by the 4 replicas"):
        check_plan(dataclasses.replace(cfg, strategy="hybrid"), CPUS[:8])   # default mesh batch:4,model:2


@pytest.mark.parametrize("change, num_devices, needle", [
    ({"strategy": "model", "mesh": "batch:2,model:2"}, 2, "needs 4 devices but 2 are used"),
    ({"strategy": "model", "mesh": "batch:2,model:2"}, 4, "--strategy=model puts every device on the model axis"),
    ({"strategy": "hybrid"}, 2, "--strategy=hybrid needs both mesh axes > 1, not batch:1,model:2"),
    ({"strategy": "model", "layout": "conv_data_fc_model", "batch_size": 30}, 4,
     "does not divide by the 4 devices conv_data_fc_model splits it over"),
    ({"all_reduce": "nccl"}, 2, "--all_reduce=nccl needs GPUs"),
])
def test_plans_the_devices_cannot_run_name_the_fix(change, num_devices, needle):
    with pytest.raises(UsageError, match=needle):
        check_plan(dataclasses.replace(Config(batch_size=32), **change), CPUS[:num_devices])


@pytest.mark.parametrize("change, needle", [
    ({"strategy": "single"}, "--strategy=single runs on one device, but TF_CONFIG describes 2 workers"),
    ({"device_memory_limit": 100}, "--device_memory_limit and --logical_gpus apply to one process"),
    ({"all_reduce": "one_device"}, "--all_reduce=one_device is for one process"),
    ({"strategy": "model", "layout": "conv_data_fc_model"}, "conv_data_fc_model runs in one process"),
    ({"strategy": "hybrid", "mesh": "batch:3,model:2"}, "the model axis must divide or be a multiple"),
])
def test_clusters_refuse_what_runs_in_one_process(change, needle):
    cluster = Cluster(("a:1", "b:2"), 0, "TF_CONFIG")
    with pytest.raises(UsageError, match=needle):
        check_plan(dataclasses.replace(Config(batch_size=48), **change), CPUS[:6], cluster)
    check_plan(Config(batch_size=48), CPUS[:6], cluster)


def test_json_round_trip(tmp_path):
    cfg = Config(run_dir=str(tmp_path), strategy="single", steps=7, data_dir=None, learning_rate=0.3)
    cfg.write(tmp_path / "config.json")
    assert load_config(tmp_path / "config.json") == cfg


def test_resume_refuses_other_results_but_allows_more_steps_or_devices():
    old = Config(run_dir="r", steps=10)
    check_resumable(old, dataclasses.replace(old, steps=20, strategy="single", num_devices=1))
    with pytest.raises(UsageError, match=r"--batch_size: 64 -> 128.*use a new --run_dir"):
        check_resumable(old, dataclasses.replace(old, batch_size=128))
