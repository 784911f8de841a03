"""Where a run's files live under --run_dir: the one definition of the layout, shared by
training, export and the tools (training/run_dir.py restores, locks and writes; the rules for
an earlier run's directory and the atomic writer are config/config.py's).

Layout: config.json, checkpoints/, tensorboard/, summary.json, export/, and with
--profile_steps comm_report.json and comm_report.md; while a run trains, .training.lock
(training/run_dir.py `writing_alone`).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: str

    @property
    def config(self):
        return os.path.join(self.root, "config.json")

    @property
    def checkpoints(self):
        return os.path.join(self.root, "checkpoints")

    @property
    def tensorboard(self):
        return os.path.join(self.root, "tensorboard")

    @property
    def summary(self):
        return os.path.join(self.root, "summary.json")

    @property
    def export(self):
        return os.path.join(self.root, "export")

    @property
    def comm_report(self):
        """The communication report, without its extension (.json and .md are written)."""
        return os.path.join(self.root, "comm_report")

    def saved_comm_report(self) -> str:
        """comm_report.json, which a profiled run writes; FileNotFoundError naming the fix if
        the run was not profiled."""
        path = self.comm_report + ".json"
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} not found: train with --profile_steps=A,B first")
        return path
