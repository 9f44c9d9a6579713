#!/usr/bin/env bash
# The GPU runs of session 2 (2026-11-29) on one host of 2 H200, one stage per device call; jobs on the two
# GPUs run side by side (CUDA_VISIBLE_DEVICES), every job under `timeout`, logs and JSON under $OUT.
# Run from the repository root with the repository on PYTHONPATH (../shared/device/README.md):
#   bash scripts/bench/gpu_session.sh head      # fused head: GPU tests + logprobs bench | e2e 0.5B, 1.5B
#   bash scripts/bench/gpu_session.sh budget    # e2e with a 32k-token micro-batch budget | update bench
#   bash scripts/bench/gpu_session.sh trl       # TRL 0.5B | TRL 1.5B (same host, same settings)
#   bash scripts/bench/gpu_session.sh 7b        # e2e 7B on both GPUs (TP=2, rollout TP=2, recompute)
#   bash scripts/bench/gpu_session.sh vllm      # vLLM checks + rollout bench 0.5B | rollout bench 1.5B native
#   bash scripts/bench/gpu_session.sh vllm2     # rollout 1.5B + 7B with vLLM | e2e 0.5B with vLLM rollout
#   bash scripts/bench/gpu_session.sh vllm3     # vLLM GPU tests (1 and 2 GPUs), then what logprobs/seeds cost
#   bash scripts/bench/gpu_session.sh profile7b # kernel profile of the native 7B rollout (graphs | eager)
# Session 3 (2026-11-30):
#   bash scripts/bench/gpu_session.sh s3probe   # decode attention kernels + 7B rollout profile | TRL 7B
#   bash scripts/bench/gpu_session.sh s3kernels # GPU tests + rollout 7B (profiled) | decode attention sweep +
#                                               # rollout 0.5B, 1.5B; native vs native_flash vs native_plain
#   bash scripts/bench/gpu_session.sh s3e2e     # e2e 0.5B + rollout 0.5B, 7B | e2e 1.5B + rollout 1.5B
#   bash scripts/bench/gpu_session.sh s3e2e7b   # e2e 7B on both GPUs: no recompute (4k budget), recompute (16k)
#   bash scripts/bench/gpu_session.sh s3e2e7bdp # e2e 7B on both GPUs as DP=2 with the distributed optimizer
# Session 4 (2026-11-30; vLLM installed first, ../shared/device/README.md):
#   bash scripts/bench/gpu_session.sh s4vllm    # e2e 1.5B with vLLM rollout | the same without rollout
#                                               # log-probs; then the 2-GPU vLLM test (TP=2)
#   bash scripts/bench/gpu_session.sh s4vllm7b  # e2e 7B, DP=2, vLLM rollout (0.3 of the GPU: the training
#                                               # state holds ~90 GB when vLLM starts); e2e 0.5B, DP=2, native
#   bash scripts/bench/gpu_session.sh dp2       # e2e 0.5B and 1.5B on 2 GPUs (DP=2), native (no vLLM needed)
set -u
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
bench=scripts/bench
on() {  # on GPU SECONDS NAME CMD...: one job, stdout appended to $out/NAME.json, stderr to $out/NAME.err
  local gpu=$1 secs=$2 name=$3
  shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout "$secs" "$@" >> "$out/$name.json" 2> "$out/$name.err"
  echo "$name rc=$?" >> "$out/status.txt"
}
case "${1:-head}" in
head)
  {
    on 0 120 gpu_tests python -m pytest -q -rs -m gpu tests/engine/test_fused_logprobs.py tests/engine/test_rollout_gpu.py
    on 0 90 logprobs_0_5b python $bench/logprobs.py --hidden 896 --rows 21
    on 0 90 logprobs_1_5b python $bench/logprobs.py --hidden 1536 --rows 21
  } &
  {
    on 1 200 e2e_0_5b python $bench/e2e.py --preset qwen2_5_0_5b
    on 1 240 e2e_1_5b python $bench/e2e.py --preset qwen2_5_1_5b
  } &
  wait ;;
budget)
  {
    on 0 200 e2e_0_5b_32k python $bench/e2e.py --preset qwen2_5_0_5b --max-tokens 32768
    on 0 240 e2e_1_5b_32k python $bench/e2e.py --preset qwen2_5_1_5b --max-tokens 32768
  } &
  {
    on 1 420 update_1_5b python $bench/update.py --preset qwen2_5_1_5b --rows 64 --seq 768 --prompt-len 256 \
      --max-tokens 16384 --variants none,rms_norm,rope,all,all+foreach_adam --warmup 2 --iters 5 --profile --out "$out"
  } &
  wait ;;
trl)
  on 0 300 trl_0_5b python $bench/trl_grpo.py --preset qwen2_5_0_5b &
  on 1 300 trl_1_5b python $bench/trl_grpo.py --preset qwen2_5_1_5b &
  wait ;;
7b)
  on 0,1 400 e2e_7b python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 2 --rollout-tp 2 --max-tokens 6144 model.recompute=true ;;
vllm)
  on 0 560 vllm_check env BUDGET_S=500 bash $bench/vllm_gpu_check.sh &
  on 1 300 rollout_1_5b_native python $bench/rollout.py --preset qwen2_5_1_5b --backends native,transformers &
  wait ;;
vllm2)
  {
    on 0 250 rollout_1_5b python $bench/rollout.py --preset qwen2_5_1_5b --backends native,vllm
    on 0 300 rollout_7b python $bench/rollout.py --preset qwen2_5_7b --backends native,vllm
  } &
  on 1 500 e2e_0_5b_vllm python $bench/e2e.py --preset qwen2_5_0_5b --backend vllm &
  wait ;;
vllm3)
  on 0,1 300 vllm_tests python -m pytest -q -rA -m "gpu or vllm" tests/engine/test_rollout_vllm.py
  on 0 240 vllm_cost_0_5b python $bench/vllm_sampling_cost.py --preset qwen2_5_0_5b &
  on 1 240 vllm_cost_1_5b python $bench/vllm_sampling_cost.py --preset qwen2_5_1_5b &
  wait ;;
profile7b)  # next: where the native 7B decode trails vLLM (graphs | eager)
  on 0 300 rollout_7b_profile python $bench/rollout.py --preset qwen2_5_7b --backends native --profile "$out" &
  on 1 400 rollout_7b_profile_eager python $bench/rollout.py --preset qwen2_5_7b --backends native \
    --no-cuda-graphs --profile "$out/eager" &
  wait ;;
s3probe)
  {
    for p in qwen2_5_0_5b qwen2_5_1_5b qwen2_5_7b; do
      on 0 90 decode_attention python $bench/decode_attention.py --preset $p
    done
    on 0 300 rollout_7b_profile python $bench/rollout.py --preset qwen2_5_7b --backends native --profile "$out"
  } &
  on 1 560 trl_7b python $bench/trl_grpo.py --preset qwen2_5_7b --steps 2 --micro-batch 8 --gradient-checkpointing &
  wait ;;
s3kernels)
  {
    on 0 200 gpu_tests python -m pytest -q -rs -m gpu tests/engine/test_rollout_gpu.py tests/engine/test_fused_logprobs.py
    on 0 300 rollout_7b python $bench/rollout.py --preset qwen2_5_7b --backends native,native_flash,native_plain --profile "$out"
  } &
  {
    on 1 200 decode_attention python $bench/decode_attention.py --preset qwen2_5_7b --sweep
    on 1 200 rollout_0_5b python $bench/rollout.py --preset qwen2_5_0_5b --backends native,native_flash,native_plain
    on 1 200 rollout_1_5b python $bench/rollout.py --preset qwen2_5_1_5b --backends native,native_flash,native_plain
  } &
  wait ;;
s3e2e)
  {
    on 0 200 e2e_0_5b python $bench/e2e.py --preset qwen2_5_0_5b
    on 0 100 rollout_0_5b python $bench/rollout.py --preset qwen2_5_0_5b --backends native,native_plain
    on 0 150 rollout_7b python $bench/rollout.py --preset qwen2_5_7b --backends native,native_plain
  } &
  {
    on 1 260 e2e_1_5b python $bench/e2e.py --preset qwen2_5_1_5b
    on 1 100 rollout_1_5b python $bench/rollout.py --preset qwen2_5_1_5b --backends native,native_plain
  } &
  wait ;;
s3e2e7b)
  on 0,1 260 e2e_7b python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 2 --rollout-tp 2 --max-tokens 4096
  on 0,1 260 e2e_7b_recompute python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 2 --rollout-tp 2 \
    --max-tokens 16384 model.recompute=true ;;
s3e2e7bdp)
  on 0,1 330 e2e_7b_dp2 python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 1 --rollout-tp 1 --max-tokens 4096 \
    optim.distributed_optimizer=true ;;
s4vllm)
  on 0 270 e2e_1_5b_vllm python $bench/e2e.py --preset qwen2_5_1_5b --backend vllm &
  on 1 270 e2e_1_5b_vllm_no_lp python $bench/e2e.py --preset qwen2_5_1_5b --backend vllm rollout.log_probs=false &
  wait
  on 0,1 150 vllm_tests python -m pytest -q -rA -m "gpu or vllm" -k tp2 tests/engine/test_rollout_vllm.py ;;
s4vllm7b)
  on 0,1 360 e2e_7b_dp2_vllm python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 1 --rollout-tp 1 \
    --max-tokens 4096 --backend vllm optim.distributed_optimizer=true rollout.gpu_memory_utilization=0.3
  on 0,1 180 e2e_0_5b_dp2 python $bench/e2e.py --preset qwen2_5_0_5b --gpus 2 ;;
dp2)
  on 0,1 200 e2e_0_5b_dp2 python $bench/e2e.py --preset qwen2_5_0_5b --gpus 2
  on 0,1 240 e2e_1_5b_dp2 python $bench/e2e.py --preset qwen2_5_1_5b --gpus 2 ;;
*) echo "usage: $0 head|budget|trl|7b|vllm|vllm2|vllm3|profile7b|s3probe|s3kernels|s3e2e|s3e2e7b|s3e2e7bdp|s4vllm|s4vllm7b|dp2" >&2
  exit 2 ;;
esac
for f in "$out"/*.err; do  # one file of stderr tails (few files come back from a device call)
  [ -s "$f" ] && { echo "== $f"; tail -n 30 "$f"; } >> "$out/stderr_tails.txt"
  rm -f "$f"
done
cat "$out/status.txt"
