"""The device mesh as data: `--mesh=batch:B,model:M` parsed, and the mesh each strategy runs on.

Pure Python (no TensorFlow), so the config can parse --mesh while it is built, before
TensorFlow starts (and check a --num_devices against --cpu_devices: `check_device_count`).
The mesh has two axes: `batch` (B data-parallel groups) and `model` (the M devices that share
each split layer); a shape is the dict {"batch": B, "model": M}.
`dtensor_mesh.py` builds the DTensor mesh of that shape.
"""

from __future__ import annotations

from tf_multigpu.errors import UsageError

AXES = ("batch", "model")


def parse_mesh(text: str) -> dict:
    """`batch:B,model:M` -> {"batch": B, "model": M} (a missing axis has size 1)."""
    shape = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition(":")
        if axis not in AXES or not size.isdigit() or int(size) < 1 or axis in shape:
            raise UsageError(f"--mesh={text!r} is not batch:B,model:M with B, M >= 1, e.g. --mesh=batch:2,model:2")
        shape[axis] = int(size)
    return {"batch": shape.get("batch", 1), "model": shape.get("model", 1)}


def mesh_for(strategy: str, mesh_shape: dict | None, num_devices: int) -> dict:
    """The mesh shape: `mesh_shape` (--mesh, parsed) if given; else all devices on `model`
    (model), or pairs of model-parallel devices, data parallel between the pairs (hybrid, as
    in the paper)."""
    if mesh_shape:
        return dict(mesh_shape)
    if strategy == "model":
        return {"batch": 1, "model": num_devices}
    return {"batch": max(num_devices // 2, 1), "model": 2}


def replicas_for(strategy: str, num_devices: int, mesh_shape: dict | None = None) -> int:
    """Data-parallel replicas of a strategy on `num_devices`: the global batch splits this many ways."""
    if strategy in ("model", "hybrid"):
        return mesh_for(strategy, mesh_shape, num_devices)["batch"]
    return 1 if strategy == "single" else num_devices


def mesh_flag(mesh_shape: dict) -> str:
    """{"batch": B, "model": M} -> the --mesh value `batch:B,model:M`."""
    return f"batch:{mesh_shape['batch']},model:{mesh_shape['model']}"


def check_device_count(wanted: int, found: int, kind: str) -> None:
    """--num_devices must not ask for more devices of `kind` (CPU, GPU) than exist."""
    if wanted > found:
        hint = (f"use --cpu_devices>={wanted}" if kind == "CPU" else
                f"use --num_devices<={found}, or --cpu_devices={wanted} to test on logical CPUs")
        raise UsageError(f"--num_devices={wanted} but only {found} {kind} devices exist: {hint}")
