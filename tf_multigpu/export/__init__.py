"""Exporting trained networks: a plain single-device SavedModel with a serving signature."""

from tf_multigpu.export.saved_model import METADATA_FILE, SIGNATURE, export_saved_model

__all__ = ["export_saved_model", "SIGNATURE", "METADATA_FILE"]
