"""Run configuration: flag definitions, the frozen, validated Config built from them, the
rules a config must meet on its devices and cluster (`check_plan`), and what a run directory
must hold to be exported (`check_exportable_run`), all decided without TensorFlow."""

from tf_multigpu.config.config import (
    RESULT_FIELDS,
    Config,
    check_exportable_run,
    check_previous_run,
    check_resumable,
    load_config,
    no_checkpoint,
)
from tf_multigpu.config.plan_checks import check_before_start, check_cluster, check_plan
from tf_multigpu.config.run_paths import RunPaths

__all__ = ["Config", "RESULT_FIELDS", "RunPaths", "check_before_start", "check_cluster", "check_plan",
           "check_exportable_run", "check_previous_run", "check_resumable", "load_config", "no_checkpoint"]
