"""The parallelism planner: which strategy, mesh and layout trains a model fastest on given devices.

`cost_model` counts each layer's FLOPs and bytes under every layout; `device_profile` says
what the devices can do (shipped JSON profiles, or a micro-benchmark); `comm` times each
collective algorithm on the profile's topology; `predict` turns them into a ranked table of
plans; `published` holds the published tables two profiles are fitted to and reproduce;
`auto` resolves `--strategy=auto` for the training loop.
"""

from tf_multigpu.planner.cost_model import ModelCost, analyze
from tf_multigpu.planner.device_profile import (
           DeviceProfile,
           builtin_names,
           load,
           measure,
)
from tf_multigpu.planner.predict import (
           Assumptions,
           Plan,
           PlanTable,
           plan_table,
           to_markdown,
)

__all__ = ["Assumptions", "DeviceProfile", "ModelCost", "Plan", "PlanTable", "analyze", "builtin_names",
           "load", "measure", "plan_table", "to_markdown"]
