"""Does the planner rank plans as they measure? Predicted against measured step times.

    python -m tools.plan_vs_measured --model=small_convnet --dataset=digits --batch_size=256
    python -m tools.plan_vs_measured --model=alexnet --dataset=synthetic --image_size=64 --batch_size=64

On --cpu_devices logical CPU devices, in --rounds interleaved rounds: each round measures a
device profile and predicts every plan with it (the plans are the first profile's that fit),
then trains each plan in a FRESH process (`python -m tf_multigpu.train`: a second DTensor
mesh in one process can hang, BUILD_NOTES.md), for --steps steps or --seconds of steady state
at the predicted step time, whichever is longer, and reads its summary.json
`step_time_s` (the warm-up window excluded). Prints, as Markdown: predicted and measured step
time per plan, their ratio, both rankings, Kendall's tau between them (tau-a, computed here)
and the pairs of plans the two orders disagree on. Logical CPUs share the machine's cores, and
other jobs may share the machine: the times are noisy (the load average is printed).
"""

import json
import math
import os
import subprocess
import sys
import tempfile

from absl import flags, logging

from tf_multigpu import cli
from tf_multigpu.config import RunPaths
from tf_multigpu.config.workload_flags import define_workload_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = "plan_vs_measured"
_WORKLOAD = define_workload_flags(("model", "dataset", "image_size", "batch_size"), batch_size=256)
flags.DEFINE_integer("cpu_devices", 4, "Logical CPU devices.")
flags.DEFINE_integer("steps", 30, "Training steps per plan, at least (the first --log_every are warm-up).")
flags.DEFINE_float("seconds", 8.0, "Steady-state seconds to time per run, at least: a plan predicted to step "
                   "faster than --seconds / --steps gets more steps (a short window is a noisy one).")
flags.DEFINE_integer("log_every", 5, "Logging window; the first window is not timed.")
flags.DEFINE_integer("rounds", 4, "Fresh runs per plan, in interleaved rounds; the fastest is kept (a busy "
                     "spell on the shared cores slows one run, not the plan: on 2 cores one plan's four runs "
                     "took 26-53 ms a step, and 2 rounds left plans misordered).")
FLAGS = flags.FLAGS


def kendall_tau(xs, ys) -> tuple[float, list]:
    """Kendall's tau-a of two score lists, and the index pairs ordered differently."""
    n, concordant, disagree = len(xs), 0, []
    for i in range(n):
        for j in range(i + 1, n):
            s = (xs[i] - xs[j]) * (ys[i] - ys[j])
            if s > 0:
                concordant += 1
            elif s < 0:
                disagree.append((i, j))
    pairs = n * (n - 1) // 2
    return ((concordant - len(disagree)) / pairs if pairs else 1.0), disagree


def ranks(values) -> list:
    """1-based rank of each value, smallest first (a plan's place in the table's order)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    return [order.index(i) + 1 for i in range(len(values))]


def unresolved_pairs(runs) -> set:
    """The index pairs of plans whose best measured times differ by less than either plan's
    spread over its own runs (`runs`: one list of times per round): the measurement itself
    cannot order them, and a prediction ordering them either way is not contradicted."""
    best = [min(times) for times in zip(*runs)]
    spread = [max(times) - min(times) for times in zip(*runs)]
    return {(i, j) for i in range(len(best)) for j in range(i + 1, len(best))
            if abs(best[i] - best[j]) < max(spread[i], spread[j])}


def tau_over_resolved(num_plans: int, disagree, unresolved) -> tuple[float, list, list]:
    """(Kendall's tau over the pairs the runs order, those pairs, the ones the prediction
    orders differently). Tied predictions count as neither agreeing nor disagreeing: none
    occur among measured plans, whose predicted times are continuous."""
    resolved = [(i, j) for i in range(num_plans) for j in range(i + 1, num_plans) if (i, j) not in unresolved]
    wrong = [pair for pair in disagree if pair not in unresolved]
    return ((len(resolved) - 2 * len(wrong)) / len(resolved) if resolved else 1.0), resolved, wrong


def steps_to_run(predicted_s: float, min_steps: int, seconds: float, log_every: int) -> int:
    """Steps for one run: at least `min_steps`, and enough whole windows after the warm-up
    window to time about `seconds` at the predicted step time (25 steps of a 30 ms plan is a
    0.75 s window, whose time swung by 30% between runs of one plan)."""
    timed = math.ceil(seconds / max(predicted_s, 1e-6) / log_every) * log_every
    return max(min_steps, log_every + timed)


def measure_plan(plan, workdir) -> float:
    """Steady-state step time of `plan`, trained in a fresh process for steps_to_run steps."""
    run_dir = os.path.join(workdir, plan.label.replace(" ", "_"))
    steps = steps_to_run(plan.step_time_s, FLAGS.steps, FLAGS.seconds, FLAGS.log_every)
    args = [sys.executable, "-m", "tf_multigpu.train", f"--run_dir={run_dir}", f"--model={FLAGS.model}",
            f"--dataset={FLAGS.dataset}", f"--batch_size={FLAGS.batch_size}", f"--steps={steps}",
            f"--log_every={FLAGS.log_every}", f"--checkpoint_every={steps}",
            f"--eval_every={steps}", f"--cpu_devices={FLAGS.cpu_devices}", "--noexport",
            *plan.flags().split()]
    if FLAGS.image_size:
        args.append(f"--image_size={FLAGS.image_size}")
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{plan.label} failed: {done.stderr.strip().splitlines()[-1]}")
    with open(RunPaths(run_dir).summary) as f:
        return json.load(f)["step_time_s"]


def main(argv):
    if len(argv) > 1:
        cli.fail(PROG, f"unexpected arguments {argv[1:]}: every option is a --flag (see --help)")
    if FLAGS.rounds < 1:
        cli.fail(PROG, f"--rounds={FLAGS.rounds}: give at least 1")
    if FLAGS.seconds < 0:
        cli.fail(PROG, f"--seconds={FLAGS.seconds:g}: give 0 (--steps alone) or more")
    logging.set_verbosity(logging.ERROR)
    cli.start_tensorflow()
    from tf_multigpu import planner
    from tf_multigpu.data import load_source
    from tf_multigpu.models import build_model
    from tf_multigpu.parallel import configure_devices

    devices = configure_devices(0, FLAGS.cpu_devices)
    source = load_source(FLAGS.dataset, None, FLAGS.image_size)
    model = build_model(FLAGS.model, source.image_shape, source.num_classes)
    cost = planner.analyze(model)
    plans, tables, runs = None, [], []
    with tempfile.TemporaryDirectory() as workdir:
        for r in range(FLAGS.rounds):
            # A profile per round, timed just before its runs: a slow spell that lasts the whole
            # profile (one device alone measured 80 GFLOP/s in one run of this tool, 142 in the
            # next) must not set every prediction, as it cannot set every measurement.
            profile = planner.measure_for_run(devices, model, source, FLAGS.batch_size)
            table = {p.label: p for p in planner.plan_table(cost, profile, len(devices), FLAGS.batch_size).plans}
            if plans is None:   # the first profile's plans that fit, run in every round
                plans = [p for p in table.values() if p.fits]
            tables.append((profile, table))
            runs.append([measure_plan(p, os.path.join(workdir, str(r))) for p in plans])
    # Both sides the fastest of the rounds: each plan's prediction from its fastest profile.
    fastest = [min((table[p.label] for _, table in tables), key=lambda q: q.step_time_s) for p in plans]
    measured = [min(times) for times in zip(*runs)]
    predicted = [p.step_time_s for p in fastest]
    tau, disagree = kendall_tau(predicted, measured)
    # Ranked by the predictions shown, the fastest profile's per plan: with several profiles
    # these need not keep the first profile's order, which the plans are listed in.
    predicted_rank, measured_rank = ranks(predicted), ranks(measured)
    print(f"## {FLAGS.model}, {source.name} {source.image_shape}, global batch {FLAGS.batch_size}, "
          f"{len(devices)} logical CPU devices, at least {FLAGS.steps} steps and {FLAGS.seconds:g} s timed per run, "
          f"best of {FLAGS.rounds} runs and of as many profiles, one before each round\n")
    print("| plan | predicted ms (compute + communication + input) | predicted ms (each profile) "
          "| measured ms (each run) | measured / predicted | predicted rank | measured rank |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i in sorted(range(len(plans)), key=lambda i: predicted[i]):   # in predicted order
        p = fastest[i]
        comm_s = max(p.step_time_s - p.compute_s - p.input_s, 0.0)   # a difference: -0.0 on one device
        parts = f"{p.compute_s * 1e3:.1f} + {comm_s * 1e3:.1f} + {p.input_s * 1e3:.1f}"
        each = ", ".join(f"{r[i] * 1e3:.1f}" for r in runs)
        each_profile = ", ".join(f"{table[p.label].step_time_s * 1e3:.1f}" for _, table in tables)
        print(f"| {p.label} | {predicted[i] * 1e3:.1f} ({parts}) | {each_profile} | {measured[i] * 1e3:.1f} ({each}) | "
              f"{measured[i] / predicted[i]:.2f} | {predicted_rank[i]} | {measured_rank[i]} |")
    ratios = [m / p for m, p in zip(measured, predicted)]
    print(f"\nKendall's tau (predicted vs measured order): {tau:.2f} over {len(plans)} plans; "
          f"measured / predicted from {min(ratios):.2f} to {max(ratios):.2f}.")
    unresolved = unresolved_pairs(runs)   # none with one round: no spread
    if unresolved:
        tau_resolved, resolved, wrong = tau_over_resolved(len(plans), disagree, unresolved)
        print(f"Pairs closer than their own runs' spread (the measurement does not order them): {len(unresolved)} "
              f"of {len(plans) * (len(plans) - 1) // 2}; over the {len(resolved)} others, the predicted order is "
              f"wrong for {len(wrong)} (tau {tau_resolved:.2f}).")
    if disagree:
        print("Pairs ordered differently: " + "; ".join(
            f"{plans[i].label} vs {plans[j].label} (predicted {predicted[i] * 1e3:.0f} vs {predicted[j] * 1e3:.0f} ms, "
            f"measured {measured[i] * 1e3:.0f} vs {measured[j] * 1e3:.0f} ms"
            + (", within the runs' spread)" if (i, j) in unresolved else ")") for i, j in disagree))
    print()
    for r, (p, _) in enumerate(tables):
        rates = ", ".join(f"{x / 1e9:.1f} at {b}" for b, x in sorted(p.batch_flops_per_s.items()))
        dense = ", ".join(f"{x / 1e9:.1f} at {b}" for b, x in sorted(p.batch_dense_flops_per_s.items()))
        print(f"Measured profile {r + 1}: GFLOP/s per device (the model's step, fwd+bwd) with all busy {rates} "
              "examples per device"
              + (f" for the layers other than Dense, {dense} for the Dense layers" if dense else "") + ", "
              f"{p.alone_flops_per_s / 1e9:.1f} alone; momentum update {p.memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s "
              f"per device with all busy, {p.single_device_memory_bandwidth_bytes_per_s / 1e9:.2f} alone; "
              f"{p.per_op_overhead_s * 1e6:.1f} us per op; all-reduce {p.link_bandwidth_bytes_per_s / 1e9:.2f} GB/s, "
              f"{p.collective_overhead_s * 1e3:.2f} ms per collective; "
              "split conv " + ", ".join(f"{o:.2f}x at {b}" for b, o in sorted(p.batch_split_conv_overhead.items()))
              + " tf.nn.conv2d, "
              f"{p.split_conv_replicated:.2f} of it not divided by the filters' split; input pipeline "
              f"{p.input_images_per_s:.0f} images/s alone.")
    print(f"Load average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())} (2 cores).")


def run():
    """Entry point: `python -m tools.plan_vs_measured`."""
    cli.run(main, PROG, _WORKLOAD)   # the tool's own flags are listed by --help already


if __name__ == "__main__":
    run()
