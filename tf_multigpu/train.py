"""tf-multigpu-train: the command-line entry point (also `python -m tf_multigpu.train`).

Intentionally short: parse flags, build one validated config, find the cluster (if any) and
check what the flags alone decide (`check_dataset_flags`, `check_before_start`: a mistyped mesh
or data set costs a fraction of a second, not TensorFlow's start-up), start TensorFlow quietly
(`cli.start_tensorflow`), configure the devices or start the multi-worker runtime (before
TensorFlow initialises), resolve --strategy=auto with the planner, and call the training loop
(which checks the plan against the devices: config/plan_checks.py). Bad input prints one line
and exits 2; a SIGTERM or Ctrl-C stops after a checkpoint with status 143 or 130; a lost worker is one line and
status 1.
"""

import json

from absl import flags, logging

from tf_multigpu import cli, malloc
from tf_multigpu.cli import DOES_NOT_FIT
from tf_multigpu.config import check_before_start
from tf_multigpu.config import flags as run_flags
from tf_multigpu.config.workload_flags import WORKLOAD_FLAGS
from tf_multigpu.data import check_dataset_flags
from tf_multigpu.errors import DoesNotFit, UsageError, error_reason
from tf_multigpu.training.preemption import Preempted  # pure Python: the except clause below needs it bound

PEER_LOST = 1


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    cluster = None
    try:
        cfg = run_flags.config_from_flags()
        logging.info(malloc.apply(cfg.malloc))   # may start the process again, with the allocator preloaded
        from tf_multigpu.parallel import cluster as clusters  # pure Python (Slurm's resolver starts TensorFlow)
        cluster = clusters.resolve_cluster(cfg.worker_hosts, cfg.task_index, start_tensorflow=cli.start_tensorflow)
        # before TensorFlow starts, and before a worker waits for its peers
        check_dataset_flags(cfg.dataset, cfg.image_size, cfg.augment, cfg.test_fraction, cfg.skip_bad_images)
        check_before_start(cfg, cluster)
        cli.start_tensorflow()   # quietly, before anything below imports it
        if cfg.profile_steps and cfg.strategy in ("model", "hybrid"):
            # Before TensorFlow runs anything: the report reads DTensor's lowered step graph.
            from tf_multigpu.profiling.collectives import enable_graph_dumps
            enable_graph_dumps()
        from tf_multigpu.parallel import configure_devices  # imports TensorFlow
        from tf_multigpu.training.loop import train
        if cluster:
            runtime = clusters.start_runtime(cluster, cfg.strategy, cfg.cpu_devices, cfg.num_devices, cfg.peer_timeout)
            devices = runtime.local_devices
        else:
            runtime = None
            devices = configure_devices(1 if cfg.strategy == "single" else cfg.num_devices, cfg.cpu_devices,
                                        cfg.device_memory_limit, cfg.logical_gpus)
        cfg, source, prediction = _resolve_auto(cfg, devices)
        summary = _train_with_one_line_errors(train, cfg, devices, runtime, source=source, prediction=prediction)
        if runtime is not None:   # no worker leaves while another's last collective needs it
            from tf_multigpu.compat import wait_for_all_tasks
            wait_for_all_tasks("tf_multigpu/run_finished", max(cfg.peer_timeout, 600))
    except DoesNotFit as e:
        _fail(str(e), DOES_NOT_FIT)
    except UsageError as e:
        _fail(str(e))
    except Preempted as e:
        _fail(str(e), e.exit_code)
    except Exception as e:  # noqa: BLE001  a peer lost mid-collective: one line, not a trace
        if not cluster:   # (before importing TensorFlow: the error may be that it cannot be imported)
            raise
        import tensorflow as tf
        if not isinstance(e, tf.errors.OpError):
            raise
        _fail(clusters.describe_peer_failure(e), PEER_LOST)
    print(json.dumps(summary, sort_keys=True), flush=True)


def _resolve_auto(cfg, devices):
    """(cfg, the data set or None, the planner's prediction or None): --strategy=auto replaced
    by the planner's top plan for these devices. The data set it loaded goes on to the run."""
    if cfg.strategy != "auto":
        return cfg, None, None
    from tf_multigpu.models import get_factory
    from tf_multigpu.planner.auto import resolve_strategy
    from tf_multigpu.training.run import load_run_source
    get_factory(cfg.model)   # an unknown model is reported before the data set is loaded
    source = load_run_source(cfg)
    cfg, prediction = resolve_strategy(cfg, devices, source)
    return cfg, source, prediction


def _train_with_one_line_errors(train, cfg, devices, runtime, **kwargs):
    """train(), with the runtime's out-of-memory error turned into DoesNotFit (one line), and
    the errors of a full disk and of an image damaged past the checks the folder source makes
    up front (data/folder.py) turned into UsageError (one line)."""
    import tensorflow as tf
    try:
        return train(cfg, devices, runtime, **kwargs)
    except tf.errors.ResourceExhaustedError as e:
        if any(sign in str(e) for sign in _DISK_FULL):   # the disk, not the device
            raise UsageError(f"cannot write to --run_dir={cfg.run_dir} ({error_reason(e)}): free space (or raise "
                             "the limit), then run the same command again to resume") from None
        raise DoesNotFit(f"out of device memory with --strategy={cfg.strategy} --batch_size={cfg.batch_size} "
                         f"({error_reason(e, 200)}): use a smaller --batch_size or split the model "
                         "(--strategy=model or hybrid)") from None
    except tf.errors.InvalidArgumentError as e:
        if "DecodeImage" not in str(e) and "decode_image" not in str(e):
            raise
        raise UsageError(f"an image of --dataset={cfg.dataset} cannot be decoded ({error_reason(e)}): it is "
                         "damaged inside, past the first and last bytes checked before training; pass "
                         "--skip_bad_images to train without such images") from None


# ResourceExhaustedError's messages from a file system, not from a device's allocator.
_DISK_FULL = ("No space left", "Disk quota", "Too many open files", "tempstate", "SaveV2")


def _fail(message: str, status: int = cli.USAGE_ERROR):
    cli.fail('tf-multigpu-train', message, status)


def run():
    """Console-script entry point (the flags are defined in config/flags.py)."""
    cli.run(main, "tf-multigpu-train",
            [flag.name for flag in flags.FLAGS.get_flags_for_module(run_flags)] + list(WORKLOAD_FLAGS))


if __name__ == "__main__":
    run()
