#!/usr/bin/env bash
# The precision matrix of issue 41 on CUDA (the CPU one is in docs/benchmarks.md), as a second device call after
# scripts/gpu_check.sh (at most ~6 minutes on one GPU): vLLM bf16 rollouts of SmolLM2-135M-Instruct against a
# learner in fp32 and in bf16 (learner.strategy=fsdp2, world_size 1), each with no correction and with token TIS
# (correction.name=tis), 6 GRPO steps per cell, 80 s limit per cell. Per cell, medians over steps of
# |log kappa| mean / max and the share of tokens the correction keeps (correction/kept_token_frac), into
# $OUT/gpu_precision_matrix.json (or ./gpu_check_out/). Needs .venv (CUDA torch) and .venv-vllm (VLLM_BUILD=cuda).
# Not run in CI (no GPU there). Usage: bash scripts/gpu_precision_matrix.sh
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT_DIR"
PY=.venv/bin/python
VPY=.venv-vllm/bin/python
RESULTS="$OUT_DIR/gpu_precision_matrix.json"
echo "{}" > "$RESULTS"
for LP in fp32 bf16; do
  for CORR in none tis; do
    CELL="$OUT_DIR/matrix_${LP}_${CORR}"
    rm -rf "$CELL"
    CORR_ARG=()
    [ "$CORR" = tis ] && CORR_ARG=(correction.name=tis)
    echo "== learner.precision=$LP correction=$CORR"
    timeout 80 "$PY" -m posttrain.cli train smollm2_grpo steps=6 run_dir="$CELL" --no-progress \
      rollout.engine=vllm rollout.vllm.python="$VPY" rollout.vllm.dtype=bfloat16 \
      learner.strategy=fsdp2 learner.world_size=1 learner.device=cuda learner.precision="$LP" \
      eval.every=100 checkpoint_every=0 "${CORR_ARG[@]}" 2>&1 | tail -2
    "$PY" - "$CELL" "$RESULTS" "${LP}_${CORR}" <<'EOF'
import json, statistics, sys
from pathlib import Path
cell, res, key = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
m = cell / "metrics.jsonl"
rows = [json.loads(line) for line in m.read_text().splitlines()] if m.exists() else []
def med(k):
    v = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(v) if v else None
out = {"steps": sum(1 for r in rows if "logkappa_abs_mean" in r), "logkappa_abs_mean": med("logkappa_abs_mean"),
       "logkappa_abs_max": med("logkappa_abs_max"), "kept_token_frac": med("correction/kept_token_frac")}
print(key, json.dumps(out))
d = json.load(open(res)); d[key] = out; json.dump(d, open(res, "w"), indent=1)
EOF
  done
done
echo "results: $RESULTS"
