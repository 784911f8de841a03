#!/usr/bin/env bash
# tools/gpu_check.sh [OUT_DIR]  -- the numbers that matter, on a single-GPU machine, in < 8 minutes.
#
# Needs the package with its CUDA extra (pip install -e ".[cuda]"). Runs AlexNet (224x224,
# synthetic data, global batch 256, --noexport) with fresh processes per configuration:
#   * the real GPU: --strategy=single in float32, and in bfloat16 with XLA;
#   * 2 logical GPUs carved from it (--logical_gpus=2): data and model parallel;
#   * 4 logical GPUs: hybrid (batch:2,model:2).
# Logical GPUs share one chip: they show overhead and correctness on real GPU kernels, not
# speedup, and they do not use NCCL. Then prints images/s per configuration and the fraction
# of the chip's peak it reaches (AlexNet's FLOPs per image from the planner's cost model,
# 3x forward for forward + backward, over the peak of the matching shipped planner profile,
# or PEAK_TFLOPS from the environment; TF32 for float32 runs, twice that for bfloat16). Record the output in
# BUILD_NOTES.md with the date; the test suite never depends on it.
set -euo pipefail
OUT=${1:-gpu_check_out}
STEPS=${STEPS:-40}
MEM=${MEM_PER_LOGICAL_GPU_MIB:-30000}
mkdir -p "$OUT"
python3 -c "import tensorflow as tf; g = tf.config.list_physical_devices('GPU'); print('TensorFlow', tf.__version__, 'GPUs:', g); assert g, 'no GPU visible to TensorFlow: pip install -e \".[cuda]\"'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

run() {   # NAME FLAGS...
  local name=$1; shift
  echo "== $name: $*"
  if timeout 300 python3 -m tf_multigpu.train --run_dir="$OUT/$name" --model=alexnet --dataset=synthetic \
      --image_size=224 --batch_size=256 --steps="$STEPS" --log_every=10 --noexport "$@" > "$OUT/$name.log" 2>&1; then
    tail -1 "$OUT/$name.log" > "$OUT/$name.summary.json"
  else
    echo "   failed (exit $?): $(tail -1 "$OUT/$name.log")"
  fi
}

run gpu_single_fp32 --strategy=single
run gpu_single_bf16_xla --strategy=single --dtype=bfloat16 --xla
run lgpu2_data --strategy=data --logical_gpus=2 --device_memory_limit="$MEM"
run lgpu2_model --strategy=model --logical_gpus=2 --device_memory_limit="$MEM"
run lgpu4_hybrid --strategy=hybrid --logical_gpus=4 --device_memory_limit="$MEM" --mesh=batch:2,model:2
run lgpu2_data_bf16_xla --strategy=data --logical_gpus=2 --device_memory_limit="$MEM" --dtype=bfloat16 --xla

python3 - "$OUT" <<'PY'
import glob, json, os, subprocess, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
from tf_multigpu.models import build_model
from tf_multigpu.planner import cost_model, device_profile
out = sys.argv[1]
flops = 3 * cost_model.analyze(build_model("alexnet", (224, 224, 3), 1000)).fwd_flops   # per image, fwd + bwd
try:
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
except FileNotFoundError:
    name = ""
key = next((k for k in ("h200", "h100", "a100", "v100") if k in name.lower()), None)
peak_tf = float(os.environ.get("PEAK_TFLOPS", 0)) * 1e12
if not peak_tf and key:
    profile = device_profile.load(next(n for n in device_profile.builtin_names() if n.startswith(key)))
    peak_tf = profile.peak_flops_per_s
print(f"\nAlexNet: {flops / 1e9:.2f} GFLOP per image (fwd+bwd); peak used: {peak_tf / 1e12:.0f} TFLOP/s ({name.strip() or '?'})")
print("| configuration | images/s | step ms | peak fraction |\n| --- | ---: | ---: | ---: |")
for path in sorted(glob.glob(os.path.join(out, "*.summary.json"))):
    s = json.load(open(path))
    rate = s.get("examples_per_sec") or 0
    peak = peak_tf * (2 if "bf16" in path else 1)   # dense bf16 tensor cores: 2x the TF32 peak
    frac = f"{rate * flops / peak:.1%}" if peak_tf else "?"
    print(f"| {os.path.basename(path)[:-13]} | {rate:.0f} | {1000 * (s.get('step_time_s') or 0):.1f} | {frac} |")
PY
