#!/usr/bin/env bash
# One GPU check run (at most ~10 minutes on one GPU), prepared for a machine with CUDA:
#   1. facts: GPU, driver, torch / vLLM builds;
#   2. the engine contract suite against vLLM on CUDA (tests/rollout/test_engine_contract.py);
#   3. 20 GRPO steps of SmolLM2-135M-Instruct with rollout.engine=vllm (bf16) and a learner on the GPU
#      (learner.strategy=fsdp2, world_size 1, learner.precision=bf16);
#   4. figures from that run's ledger: |log kappa| in bf16 (engine mismatch) per step, rollout tokens/s,
#      learner time per step and its MFU (6 * params * trained tokens / learner seconds / peak bf16 FLOP/s).
# Every step has its own time limit and a failed step does not stop the next; results go to
# $OUT/gpu_check.json (or ./gpu_check_out/ without $OUT) and the log to the terminal.
#
# Needs: .venv (make venv, CUDA torch) and .venv-vllm (make vllm-env VLLM_BUILD=cuda) already built on
# the machine (the device machine has no network: build them where there is one, or carry them).
# Not run in CI (no GPU there). Usage: bash scripts/gpu_check.sh [PEAK_BF16_TFLOPS, default 989 (H100/H200 dense)]
# Then, as a second call: bash scripts/gpu_precision_matrix.sh (the bf16/fp32 learner x correction matrix, issue 41).
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR"
PEAK_TFLOPS="${1:-989}"
PY=.venv/bin/python
VPY=.venv-vllm/bin/python
RESULTS="$OUT_DIR/gpu_check.json"
echo "{}" > "$RESULTS"

note() {  # note KEY VALUE(JSON): merge one key into the results file
  "$PY" - "$RESULTS" "$1" "$2" <<'EOF' 2>/dev/null || echo "note $1: could not record"
import json, sys
p, k, v = sys.argv[1], sys.argv[2], sys.argv[3]
d = json.load(open(p)); d[k] = json.loads(v); json.dump(d, open(p, "w"), indent=1)
EOF
}

echo "== 1. facts"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT_DIR/gpu.txt"
for p in "$PY" "$VPY"; do
  if [ -x "$p" ]; then
    "$p" -c "import torch; print('$p', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
  else
    echo "$p missing (build: make venv / make vllm-env VLLM_BUILD=cuda)"
  fi
done
[ -x "$VPY" ] && "$VPY" -c "import vllm; print('vllm', vllm.__version__)"

echo "== 2. engine contract suite against vLLM on CUDA (limit 240 s)"
POSTTRAIN_VLLM_PYTHON="$VPY" timeout 240 "$PY" -m pytest tests/rollout/test_engine_contract.py -q -k vllm \
  -p no:cacheprovider -o addopts="--import-mode=importlib" 2>&1 | tail -5 | tee "$OUT_DIR/contract.txt"
note contract_suite "$("$PY" -c "import json,sys; print(json.dumps(open('$OUT_DIR/contract.txt').read().strip().splitlines()[-1:]))")"

echo "== 3. 20 GRPO steps, SmolLM2-135M-Instruct, vLLM (bf16) + fsdp2 learner (bf16) on one GPU (limit 300 s)"
RUN="$OUT_DIR/run"
rm -rf "$RUN"
timeout 300 "$PY" -m posttrain.cli train smollm2_grpo steps=20 run_dir="$RUN" --no-progress \
  rollout.engine=vllm rollout.vllm.python="$VPY" rollout.vllm.dtype=bfloat16 rollout.vllm.enforce_eager=false \
  learner.strategy=fsdp2 learner.world_size=1 learner.device=cuda learner.precision=bf16 \
  eval.every=10 checkpoint_every=0 2>&1 | tail -15 | tee "$OUT_DIR/train.txt"
note train_rc "${PIPESTATUS[0]}"

echo "== 4. figures from the run's ledger"
"$PY" - "$RUN" "$PEAK_TFLOPS" "$RESULTS" <<'EOF'
import json, statistics, sys
from pathlib import Path
run, peak, res = Path(sys.argv[1]), float(sys.argv[2]) * 1e12, sys.argv[3]
if not (run / "ledger").exists():
    print("no ledger: the training step did not run"); sys.exit(0)
from posttrain.models.tiny import count_parameters
from posttrain.models.smollm2 import load_smollm2
from posttrain.trajectory import Ledger
ms = Ledger(run / "ledger").read_metrics()
params = count_parameters(load_smollm2()[1])
out = {"steps": len(ms), "params": params}
lk = [m["logkappa_abs_max"] for m in ms if m.get("logkappa_abs_max") is not None]
out["logkappa_abs_max_per_step"] = lk
out["logkappa_abs_mean_median"] = statistics.median([m["logkappa_abs_mean"] for m in ms if m.get("logkappa_abs_mean") is not None] or [float("nan")])
out["rollout_tokens_per_s"] = statistics.median([m["tokens/generated"] / m["time/rollout_s"] for m in ms if m.get("time/rollout_s")])
lt = [(m["tokens/trained"], m["time/learner_s"]) for m in ms if m.get("time/learner_s")]
out["learner_s_per_step_median"] = statistics.median([s for _, s in lt])
# MFU: forward + backward ~ 6 * params FLOPs per trained token (Kaplan et al. 2020), prompt tokens not counted
out["learner_mfu_median"] = statistics.median([6 * params * n / s / peak for n, s in lt])
out["heldout"] = [(m["step"], m.get("heldout/accuracy")) for m in ms if m.get("heldout/accuracy") is not None]
print(json.dumps(out, indent=1))
d = json.load(open(res)); d["train_figures"] = out; json.dump(d, open(res, "w"), indent=1)
EOF
echo "results: $RESULTS"
