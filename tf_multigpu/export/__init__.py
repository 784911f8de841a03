"""Exporting trained networks: a plain single-device SavedModel with serving signatures.

`export_saved_model` writes a model the caller built (the training loop, at the end of a run);
`export_from_checkpoint` rebuilds a run's model from its config and a checkpoint and exports it
(the `tf-multigpu-export` command).
"""

from tf_multigpu.export.from_checkpoint import export_from_checkpoint
from tf_multigpu.export.saved_model import (
    FLOAT_SIGNATURE,
    INPUT_NAME,
    KERAS_FILE,
    METADATA_FILE,
    SIGNATURE,
    export_saved_model,
)

__all__ = ["export_saved_model", "export_from_checkpoint", "SIGNATURE", "FLOAT_SIGNATURE",
           "INPUT_NAME", "METADATA_FILE", "KERAS_FILE"]
