"""The parallelism planner: which strategy, mesh and layout trains a model fastest on given devices.

`cost_model` counts each layer's FLOPs and bytes under every layout; `device_profile` says
what the devices can do (shipped JSON profiles, or `device_bench`'s micro-benchmark); `comm` times each
collective algorithm on the profile's topology; `predict` turns them into a ranked table of
plans; `published` holds the published tables two profiles are fitted to and reproduce;
`auto` resolves `--strategy=auto` for tf-multigpu-train.

Importing the package does not import TensorFlow: the config checks a --profile name with
`device_profile.load` before the entry point starts TensorFlow quietly (cli.py). The names
below, and the submodules, load on first use.
"""

from __future__ import annotations

import importlib

_NAMES = {   # name -> the submodule that defines it
    "ModelCost": "cost_model", "analyze": "cost_model",
    "DeviceProfile": "device_profile", "builtin_names": "device_profile", "load": "device_profile",
    "measure": "device_bench", "measure_for_run": "device_bench",
    "Assumptions": "predict", "Plan": "predict", "PlanTable": "predict", "plan_table": "predict",
    "to_markdown": "predict",
}
_SUBMODULES = ("auto", "comm", "cost_model", "device_bench", "device_profile", "predict", "published")


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Assumptions", "DeviceProfile", "ModelCost", "Plan", "PlanTable", "analyze", "builtin_names",
           "load", "measure", "measure_for_run", "plan_table", "to_markdown"]
