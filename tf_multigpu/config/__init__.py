"""Run configuration: flag definitions and the frozen, validated Config built from them."""

from tf_multigpu.config.config import RESULT_FIELDS, Config, check_resumable, load_config
from tf_multigpu.config.run_paths import RunPaths

__all__ = ["Config", "RESULT_FIELDS", "RunPaths", "check_resumable", "load_config"]
