"""`--strategy=auto`: the entry point asks the planner for the fastest plan that fits.

The devices of the run are measured (`device_bench.measure_for_run`, a few seconds) or described by
a shipped profile (`--profile=NAME`, for a plan of a machine one knows), the model's
per-layer cost is taken from the plain Keras model, and the top plan of the ranked table
becomes the run's strategy, mesh and layout. tf-multigpu-train resolves it before it builds
the run (training/ knows nothing of the planner) and hands the Prediction to the loop, which
writes it next to the measured step time in summary.json: every auto run checks the model.
"""

from __future__ import annotations

import dataclasses

from tf_multigpu.config import Config
from tf_multigpu.models import build_model
from tf_multigpu.planner.cost_model import analyze
from tf_multigpu.planner.device_bench import measure_for_run
from tf_multigpu.planner.device_profile import load
from tf_multigpu.planner.predict import plan_table


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The planner's record of the plan it chose (strategy, mesh, layout, predicted times and
    memory, the profile, the ranking)."""

    record: dict

    def with_measurement(self, step_time_s) -> dict:
        """The record with the run's measured step time and their ratio (summary.json's `plan`)."""
        ratio = step_time_s / self.record["predicted_step_time_s"] if step_time_s else None
        return {**self.record, "measured_step_time_s": step_time_s, "measured_over_predicted": ratio}


def resolve_strategy(cfg: Config, devices, source, profile=None) -> tuple[Config, Prediction | None]:
    """(cfg with the top plan's strategy, mesh and layout, the prediction) for --strategy=auto;
    (cfg, None) for any other strategy. `profile` defaults to --profile: a shipped or JSON
    profile, or a measurement of `devices`. The plan is for the run's own device count."""
    if cfg.strategy != "auto":
        return cfg, None
    model = build_model(cfg.model, source.image_shape, source.num_classes)
    cost = analyze(model)
    if profile is None:
        profile = (measure_for_run(devices, model, source, cfg.batch_size, cfg.seed) if cfg.profile == "measure"
                   else load(cfg.profile))
    table = plan_table(cost, profile, len(devices), cfg.batch_size, overrides=cfg.layout_override_list)
    best = table.best
    print(f"--strategy=auto chose {best.label} ({best.flags()}): predicted {best.step_time_s * 1e3:.1f} ms "
          f"per step, {best.speedup:.2f}x one device, {best.binding}-bound, "
          f"{best.memory['total'] / 2**20:.1f} MiB per device (profile {profile.name}; "
          f"runner-up {table.plans[1].label if len(table.plans) > 1 else 'none'})", flush=True)
    resolved = dataclasses.replace(cfg, strategy=best.strategy, mesh=best.mesh, layout=best.layout or Config.layout,
                                   layout_overrides=cfg.layout_overrides if best.overrides else "")
    record = {
        "strategy": best.strategy, "mesh": best.mesh, "layout": best.layout, "label": best.label,
        "flags": best.flags(),
        "predicted_step_time_s": best.step_time_s, "predicted_compute_s": best.compute_s,
        "predicted_activation_comm_s": best.activation_comm_s, "predicted_grad_comm_s": best.grad_comm_s,
        "predicted_memory_per_device_bytes": best.memory["total"], "predicted_speedup": best.speedup,
        "binding": best.binding, "profile": profile.to_dict(),
        "ranking": [(p.label, p.step_time_s) for p in table.plans],
    }
    return resolved, Prediction(record)
