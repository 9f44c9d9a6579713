#!/usr/bin/env bash
# The GPU runs behind scripts/bench/README.md's end-to-end figures, on one host of 2 H200. Jobs on different
# GPUs run at the same time (each sees one GPU through CUDA_VISIBLE_DEVICES; they share the host's CPUs).
#   bash scripts/bench/run_h200.sh single   # ours 0.5B | ours 1.5B, then TRL 1.5B | native rollout GPU tests
#   bash scripts/bench/run_h200.sh pair     # two-"node" NCCL rehearsal, then ours 7B on 2 GPUs (TP=2)
set -u
out=${OUT:-/tmp/bench-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
bench=scripts/bench
case "${1:-single}" in
single)
  CUDA_VISIBLE_DEVICES=0 timeout 280 python $bench/e2e.py --preset qwen2_5_0_5b >> "$out/results.jsonl" 2> "$out/e2e_0_5b.err" &
  CUDA_VISIBLE_DEVICES=1 timeout 280 python $bench/e2e.py --preset qwen2_5_1_5b >> "$out/results.jsonl" 2> "$out/e2e_1_5b.err" &
  wait
  CUDA_VISIBLE_DEVICES=0 timeout 250 python $bench/trl_grpo.py --preset qwen2_5_1_5b 2> "$out/trl.err" | grep '^{' >> "$out/results.jsonl" &
  CUDA_VISIBLE_DEVICES=1 timeout 250 python -m pytest -q -rs -m gpu tests/engine/test_rollout_gpu.py > "$out/gpu_tests.txt" 2>&1 &
  wait ;;
pair)
  port=29555
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node timeout 150 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
      --rdzv-endpoint=127.0.0.1:$port --rdzv-id=rehearsal --rdzv-conf=is_host=$((node == 0)) \
      -m engine.train cluster=single_gpu parallel.tp=2 trainer.total_steps=2 data.batch_size=8 rollout.n=4 \
      trainer.micro_batch_size=4 trainer.progress_bar=false trainer.output_dir=/tmp/two_nodes > "$out/two_nodes_$node.log" 2>&1 &
  done
  wait
  tail -n 2 /tmp/two_nodes/metrics.jsonl > "$out/two_nodes_metrics.jsonl"
  timeout 330 python $bench/e2e.py --preset qwen2_5_7b --gpus 2 --tp 2 --rollout-tp 2 >> "$out/results.jsonl" 2> "$out/e2e_7b.err" ;;
esac
