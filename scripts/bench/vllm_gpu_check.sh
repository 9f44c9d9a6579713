#!/usr/bin/env bash
# One GPU call that checks rollout.backend=vllm end to end, cheapest and clearest failure first. Run from the
# checkout root on 1 H200 with vllm 0.26 and the base wheels installed (../shared/device/README.md):
#   OUT=/tmp/out bash scripts/bench/vllm_gpu_check.sh      # or: bash scripts/bench/run.sh vllm
# Steps (each under `timeout`, the next one runs whatever the previous gave; logs in $OUT/<step>.log):
#   env    versions and the GPU
#   smoke  our VllmRollout through build_rollout_engine on a tiny random Qwen2-shaped model (bf16, eager):
#          starts, loads the weights, greedy first tokens agree with the native engine, sampled log-probs sane
#   tests  pytest -m "gpu or vllm" tests/engine/test_rollout_vllm.py (eager; vs native engine and training)
#   bench  scripts/bench/rollout.py --preset qwen2_5_0_5b, native vs vLLM (default: torch.compile + CUDA
#          graphs, as the performance anchors measured it) vs transformers -> $OUT/rollout_0_5b.json
# A summary with one PASS/FAIL line per step ends the output, then the tail of each failed step's log.
# The whole run stays within BUDGET_S seconds (default 540): the benchmark gets what the first steps leave.
set -u
out=${OUT:-/tmp/vllm-check}
mkdir -p "$out"
py=$(command -v python3 || command -v python)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# no network on the GPU machine: fail fast instead of waiting on the hub; no usage reports
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
deadline=$((SECONDS + ${BUDGET_S:-540}))
declare -A status

run_step() {  # name cap_seconds command...
  local name=$1 cap=$2
  shift 2
  local left=$((deadline - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 20)); then
    status[$name]="FAIL (skipped: ${left}s of the budget left)"
    return
  fi
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee "$out/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$out/$name.log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  if ((rc == 0)); then
    status[$name]="PASS (${took}s)"
  elif ((rc == 124 || rc == 137)); then
    status[$name]="FAIL (timeout after ${took}s)"
  else
    status[$name]="FAIL (rc=$rc after ${took}s)"
  fi
}

run_step env 60 "$py" - <<'EOF'
import megatron.core, torch, transformers, vllm
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "transformers",
      transformers.__version__, "vllm", vllm.__version__, "megatron-core", megatron.core.__version__, flush=True)
EOF

run_step smoke 120 "$py" - <<'EOF'
import importlib.util, json, time, torch
from engine.config import ModelConfig, RolloutConfig
from engine.models.builder import resolve_shape
from engine.rollout import build_rollout_engine
from engine.rollout.base import SamplingParams
from engine.rollout.native import NativeRollout
from parallel.dims import ParallelDims
from parallel.state import init_distributed

spec = importlib.util.spec_from_file_location("bench_rollout", "scripts/bench/rollout.py")  # not a package
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

groups = init_distributed(ParallelDims(world_size=1), "cuda")
m = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, num_query_groups=2,
                vocab_size=1024, max_position_embeddings=256, qkv_bias=True, tie_embeddings=True, dtype="bfloat16")
shape = resolve_shape(m, m.vocab_size, 1)
weights = bench.random_rollout_weights(shape, groups.device, seed=0)
for t in weights.params.values():
    t.mul_(10.0 if t.dim() == 2 else 1.0)  # std 0.2: clear argmax margins in bf16
start = time.perf_counter()
cfg = RolloutConfig(backend="vllm", cuda_graphs=False, max_num_seqs=16, gpu_memory_utilization=0.25)
engine = build_rollout_engine(cfg, shape, groups.device, pad_id=0, seed=0)
report = {"vllm_start_s": round(time.perf_counter() - start, 1), "v2_model_runner": engine.uses_v2_model_runner}
engine.set_weights(weights)
native = NativeRollout(shape, groups.device, 16)
native.set_weights(weights)
prompts = torch.randint(0, shape.vocab_size, (8, 12), generator=torch.Generator().manual_seed(0)).tolist()
greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
theirs, ours = engine.generate(prompts, greedy), native.generate(prompts, greedy)
same = ours.response_ids[:, 0] == theirs.response_ids[:, 0]
report["greedy_first_token_agree"] = same.float().mean().item()
report["greedy_first_logp_max_diff"] = (ours.log_probs[:, 0] - theirs.log_probs[:, 0])[same].abs().max().item()
sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1))
lp = sampled.log_probs[sampled.response_mask.bool()]
report.update(sampled_tokens=int(sampled.response_mask.sum()), sampled_logp_min_max=(lp.min().item(), lp.max().item()))
report["stats"] = engine.last_stats
print("SMOKE " + json.dumps(report), flush=True)
assert theirs.response_ids.shape == (8, 8) and report["sampled_tokens"] == 16 * 8, report
assert torch.isfinite(lp).all() and lp.max() <= 1e-4 and lp.min() > -30, report
assert report["greedy_first_token_agree"] >= 0.75 and report["greedy_first_logp_max_diff"] < 0.25, report
print("SMOKE OK", flush=True)
EOF

run_step tests 180 "$py" -m pytest -x -q -rA -m "gpu or vllm" tests/engine/test_rollout_vllm.py
if [[ ${status[tests]} == PASS* ]] && ! grep -q "PASSED.*test_vllm_matches_native_and_training_on_one_gpu" "$out/tests.log"; then
  status[tests]="FAIL (the one-GPU vLLM test did not run: skipped?)"
fi

run_step bench 600 "$py" scripts/bench/rollout.py --preset qwen2_5_0_5b --backends native,vllm,transformers \
  --out "$out/rollout_0_5b.json"
if [[ ${status[bench]} == PASS* ]]; then  # the benchmark reports a failed vLLM run in its JSON and goes on
  "$py" - "$out/rollout_0_5b.json" <<'EOF' >> "$out/bench.log" 2>&1 || status[bench]="FAIL (vLLM missing from the JSON)"
import json, sys
r = json.load(open(sys.argv[1]))["results"]
print("BENCH " + json.dumps({k: {f: v.get(f) for f in ("tokens_per_s", "seconds", "greedy_agree_first_token",
                                                       "engine_start_s", "error", "skipped")} for k, v in r.items()}))
sys.exit(0 if "tokens_per_s" in r.get("vllm", {}) else 1)
EOF
fi

echo
echo "=== summary (logs in $out)"
for step in env smoke tests bench; do
  echo "$step: ${status[$step]:-FAIL (not run)}"
done
grep -h "^SMOKE {\|^BENCH {\|RESULT {" "$out"/*.log 2>/dev/null | cut -c1-1500
for step in env smoke tests bench; do
  if [[ ${status[$step]:-FAIL} != PASS* && -f $out/$step.log ]]; then
    echo "--- $step.log: error lines, then the last 25 lines"
    grep -n "Error\|error:\|Traceback\|assert" "$out/$step.log" | tail -n 12 | cut -c1-400
    tail -n 25 "$out/$step.log" | cut -c1-400
  fi
done
