#!/usr/bin/env bash
# The benchmark suite, one purpose per call. It installs what `.whl/` carries (the GPU machine's recipe,
# ../shared/device/README.md), builds the jobs of the purpose (one per preset, and per backend for e2e),
# spreads them over the GPUs in lanes of --gpus GPUs (lanes run side by side, a lane's jobs one after the
# other), runs each under `timeout`, and writes under $OUT: <job>.json (the job's stdout: one JSON object;
# <job>.log for tests and checks), status.txt (one `<job> rc=N` line each), stderr_tails.txt.
# `--dry-run` prints the install steps and the jobs instead (tests/scripts/test_bench_run.py checks them).
set -u

usage() {
  cat <<'EOF'
usage: bash scripts/bench/run.sh PURPOSE [options] [-- ARGS]
Run from anywhere; ARGS go to the end of every job's command (argparse keeps the last value of an option,
so ARGS also override the defaults below). Purposes (script, default presets):
  e2e               one GRPO step end to end, engine.train under torchrun (e2e.py; qwen2_5_0_5b,qwen2_5_1_5b)
  rollout           generated tokens/s per rollout backend (rollout.py; qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b)
  reshard           train -> rollout weight transition, ours vs naive gather, --verify
                    (torchrun reshard.py; qwen2_5_7b, --gpus 4; --presets none: the shape from ARGS)
  update            one actor update per fused-kernel variant (update.py; qwen2_5_1_5b)
  logprobs          the fused output head vs the unfused path, --rows 21 (logprobs.py; qwen2_5_0_5b,qwen2_5_1_5b)
  decode_attention  decode attention kernels at RL shapes (decode_attention.py; qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b)
  attention_widths  the Triton decode attention at a long tail's widths in CUDA graphs, vs --before and vLLM's
                    FA3 (decode_attention_widths.py; qwen2_5_1_5b)
  sampler           the decode step's draw alone, the Triton draw vs the torch draw, by width (sampler.py)
  decode_phases     one native generate's GPU time by phase: prefill, graph capture, replays, draw; the widest
                    graph alone (decode_phases.py; qwen2_5_1_5b)
  decode_gemms      the decode step's GEMMs alone in CUDA graphs, cuBLAS vs cuBLASLt (--autotune: Inductor)
                    (decode_gemms.py; qwen2_5_1_5b)
  decode_mlp        a dense MLP at narrow decode widths, cuBLAS + compiled SwiGLU vs engine/rollout/triton_mlp.py
                    (decode_mlp.py; qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b)
  decode_overlap    a wide decode step as two half-batches on two CUDA streams against one forward
                    (decode_overlap.py; qwen2_5_1_5b)
  packed_attention  the update's attention alone over a step's packed micro-batches, per kernel
                    (packed_attention.py; qwen2_5_0_5b,qwen2_5_1_5b)
  baselines         TRL's GRPOTrainer on e2e's step (trl_grpo.py; qwen2_5_0_5b,qwen2_5_1_5b; TRL from .whl/trl)
  verl              verl 0.9.1's GRPO, FSDP + colocated vLLM, on e2e's step (verl_grpo.py; qwen2_5_0_5b; verl from
                    .whl/verl, vLLM from .whl/vllm)
  compare           one workload through ours (e2e.py, one job per --backends entry, default native,vllm) and TRL
                    both ways (trl_grpo.py, then with --vllm) (qwen2_5_0_5b,qwen2_5_1_5b); ARGS go to all four,
                    so give only options both scripts take (--prompts --n --prompt-len --response-len --steps --seed)
  vllm              one-call check of rollout.backend=vllm: versions, smoke, tests, rollout bench at 0.5B
                    (vllm_gpu_check.sh; vLLM from .whl/vllm)
  multi_turn        multi-turn episodes with a synthetic tool, native vs vLLM (multi_turn.py; qwen2_5_1_5b)
  vllm_cost         what our vLLM requests cost: log-probs, seeds (vllm_sampling_cost.py; qwen2_5_0_5b,qwen2_5_1_5b)
  gpu_tests         pytest -m "gpu or vllm" tests/ (every test marked for the GPU) (ARGS: more pytest arguments, e.g. -k tp2)
  two_nodes         two one-GPU "nodes" rendezvous over NCCL (torchrun c10d) and train 2 steps at TP=2
Options:
  --presets LIST    comma-separated conf/model presets: one job each
  --backends LIST   rollout: passed to rollout.py as --backends; e2e, compare: one job per backend (native, vllm)
  --lengths KIND    e2e, rollout, baselines, compare, packed_attention: response lengths fixed or long_tail (workload.py); the
                    job names get _KIND
  --gpus N          GPUs per job (default 1; reshard 4)
  --devices LIST    GPU ids to use (default: $CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists, else 0)
  --timeout S       seconds per job (default: per purpose)
  --tag NAME        suffix of the job names (output files), to tell runs with other ARGS apart
  --profile         rollout, update: also write kernel tables under $OUT
  --out DIR         output folder (default: $OUT, else /tmp/bench-out)
  --no-install      leave .whl/ alone
  --dry-run         print the install steps and the jobs (lane, GPUs, command), run nothing
  -h, --help        this text
Examples (scripts/bench/README.md has the command of every table):
  bash scripts/bench/run.sh e2e --presets qwen2_5_7b --gpus 2 -- --max-tokens 4096 optim.distributed_optimizer=true
  bash scripts/bench/run.sh rollout --presets qwen2_5_7b --backends native,vllm
  bash scripts/bench/run.sh compare --lengths long_tail -- --response-len 4096
EOF
}

die() {  # die MESSAGE: a usage error
  echo "run.sh: $*" >&2
  echo "run.sh: see bash scripts/bench/run.sh --help" >&2
  exit 2
}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
bench=scripts/bench
py=python3
command -v python3 > /dev/null || py=python

purpose="" presets="" backends="" lengths="" gpus="" devices="" timeout_s="" tag="" profile=0 dry=0 install=1
out=${OUT:-/tmp/bench-out}
args=()
while (($#)); do
  case $1 in
  -h | --help) usage; exit 0 ;;
  --presets) presets=${2:?--presets needs a value}; shift ;;
  --backends) backends=${2:?--backends needs a value}; shift ;;
  --lengths) lengths=${2:?--lengths needs a value}; shift ;;
  --gpus) gpus=${2:?--gpus needs a value}; shift ;;
  --devices) devices=${2:?--devices needs a value}; shift ;;
  --timeout) timeout_s=${2:?--timeout needs a value}; shift ;;
  --tag) tag=_${2:?--tag needs a value}; shift ;;
  --out) out=${2:?--out needs a value}; shift ;;
  --profile) profile=1 ;;
  --no-install) install=0 ;;
  --dry-run) dry=1 ;;
  --) shift; args=("$@"); break ;;
  -*) die "unknown option '$1'" ;;
  *) [ -z "$purpose" ] || die "one purpose per call (got '$purpose' and '$1')"; purpose=$1 ;;
  esac
  shift
done
[ -n "$purpose" ] || { usage >&2; exit 2; }

# Per purpose: default presets, GPUs per job, seconds per job; jobs that print no JSON write <job>.log.
ext=json
case $purpose in
e2e) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=300 ;;
rollout) d_presets=qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b d_gpus=1 d_timeout=300 ;;
reshard) d_presets=qwen2_5_7b d_gpus=4 d_timeout=300 ;;
update) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=420 ;;
logprobs) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=90 ;;
decode_attention) d_presets=qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b d_gpus=1 d_timeout=120 ;;
attention_widths) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=240 ;;
sampler) d_presets=none d_gpus=1 d_timeout=120 ;;
decode_phases) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=180 ;;
decode_gemms) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=240 ;;
decode_mlp) d_presets=qwen2_5_0_5b,qwen2_5_1_5b,qwen2_5_7b d_gpus=1 d_timeout=240 ;;
decode_overlap) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=240 ;;
packed_attention) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=180 ;;
baselines) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=300 ;;
verl) d_presets=qwen2_5_0_5b d_gpus=1 d_timeout=540 ;;
compare) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=420 ;;
vllm) d_presets=none d_gpus=1 d_timeout=560 ;;
vllm_cost) d_presets=qwen2_5_0_5b,qwen2_5_1_5b d_gpus=1 d_timeout=240 ;;
multi_turn) d_presets=qwen2_5_1_5b d_gpus=1 d_timeout=420 ;;
gpu_tests) d_presets=none d_gpus=1 d_timeout=420 ;;
two_nodes) d_presets=none d_gpus=1 d_timeout=150 ;;
*) die "unknown purpose '$purpose': one of e2e rollout reshard update logprobs decode_attention attention_widths sampler decode_phases decode_gemms decode_mlp decode_overlap packed_attention baselines verl compare vllm vllm_cost multi_turn gpu_tests two_nodes" ;;
esac
case $purpose in vllm | gpu_tests | two_nodes | sampler)
  [ -z "$presets" ] || die "$purpose takes no --presets"
  [ "$purpose" = sampler ] || ext=log ;;
esac
lengths_arg=() lt=""
if [ -n "$lengths" ]; then
  case $purpose in e2e | rollout | baselines | compare | verl | packed_attention) ;; *) die "$purpose takes no --lengths" ;; esac
  case $lengths in fixed | long_tail) ;; *) die "--lengths must be fixed or long_tail, got '$lengths'" ;; esac
  lengths_arg=(--lengths "$lengths") lt=_$lengths
fi
presets=${presets:-$d_presets} gpus=${gpus:-$d_gpus} timeout_s=${timeout_s:-$d_timeout}
[[ $gpus =~ ^[1-9][0-9]*$ ]] || die "--gpus must be a positive integer, got '$gpus'"
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "--timeout must be a positive number of seconds, got '$timeout_s'"
IFS=, read -ra preset_list <<< "$presets"
for p in "${preset_list[@]}"; do
  [ "$p" = none ] || [ -f "conf/model/$p.yaml" ] ||
    die "unknown preset '$p' in --presets: one of $(cd conf/model && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')"
done

if [ -z "$devices" ]; then
  devices=${CUDA_VISIBLE_DEVICES:-}
  if [ -z "$devices" ] && command -v nvidia-smi > /dev/null; then
    devices=$(nvidia-smi -L 2> /dev/null | awk 'NR > 1 {printf ","} {printf "%d", NR - 1}')
  fi
  devices=${devices:-0}
fi
IFS=, read -ra device_list <<< "$devices"
num_lanes=$((${#device_list[@]} / gpus))
((num_lanes >= 1)) || die "a $purpose job takes $gpus GPUs (--gpus) but --devices has ${#device_list[@]} ($devices)"

names=() cmds=()
add_job() {  # add_job NAME CMD...: one job; the command is kept shell-quoted
  names+=("$1")
  shift
  cmds+=("$(printf '%q ' "$@")")
}
short() { [ "$1" = none ] && echo custom || echo "${1#qwen2_5_}"; }  # qwen2_5_0_5b -> 0_5b
preset_arg() { [ "$1" = none ] || printf '%s\n' --preset "$1"; }

for p in "${preset_list[@]}"; do
  s=$(short "$p")
  mapfile -t pa < <(preset_arg "$p")
  case $purpose in
  e2e)
    IFS=, read -ra backend_list <<< "${backends:-native}"
    for b in "${backend_list[@]}"; do
      add_job "e2e_$s$([ "$b" = native ] || echo "_$b")$lt$tag" \
        "$py" $bench/e2e.py "${pa[@]}" --gpus "$gpus" --backend "$b" "${lengths_arg[@]}" "${args[@]}"
    done ;;
  compare)
    IFS=, read -ra backend_list <<< "${backends:-native,vllm}"
    for b in "${backend_list[@]}"; do
      add_job "e2e_$s$([ "$b" = native ] || echo "_$b")$lt$tag" \
        "$py" $bench/e2e.py "${pa[@]}" --gpus "$gpus" --backend "$b" "${lengths_arg[@]}" "${args[@]}"
    done
    add_job "trl_$s$lt$tag" "$py" $bench/trl_grpo.py "${pa[@]}" "${lengths_arg[@]}" "${args[@]}"
    add_job "trl_${s}_vllm$lt$tag" "$py" $bench/trl_grpo.py "${pa[@]}" --vllm "${lengths_arg[@]}" "${args[@]}" ;;
  rollout)
    extra=()
    [ -z "$backends" ] || extra+=(--backends "$backends")
    ((profile)) && extra+=(--profile "$out/profile_rollout_$s$tag")
    add_job "rollout_$s$lt$tag" "$py" $bench/rollout.py "${pa[@]}" "${extra[@]}" "${lengths_arg[@]}" "${args[@]}" ;;
  reshard)
    add_job "reshard_$s$tag" torchrun --standalone --nproc-per-node="$gpus" $bench/reshard.py "${pa[@]}" --verify \
      "${args[@]}" ;;
  update)
    extra=(--out "$out/update_$s$tag")
    ((profile)) && extra+=(--profile)
    add_job "update_$s$tag" "$py" $bench/update.py "${pa[@]}" "${extra[@]}" "${args[@]}" ;;
  logprobs) add_job "logprobs_$s$tag" "$py" $bench/logprobs.py "${pa[@]}" --rows 21 "${args[@]}" ;;
  decode_attention) add_job "decode_attention_$s$tag" "$py" $bench/decode_attention.py "${pa[@]}" "${args[@]}" ;;
  attention_widths)
    add_job "attention_widths_$s$tag" "$py" $bench/decode_attention_widths.py "${pa[@]}" "${args[@]}" ;;
  sampler) add_job "sampler$tag" "$py" $bench/sampler.py "${args[@]}" ;;
  decode_phases) add_job "decode_phases_$s$tag" "$py" $bench/decode_phases.py "${pa[@]}" "${args[@]}" ;;
  decode_gemms) add_job "decode_gemms_$s$tag" "$py" $bench/decode_gemms.py "${pa[@]}" "${args[@]}" ;;
  decode_mlp) add_job "decode_mlp_$s$tag" "$py" $bench/decode_mlp.py "${pa[@]}" "${args[@]}" ;;
  decode_overlap) add_job "decode_overlap_$s$tag" "$py" $bench/decode_overlap.py "${pa[@]}" "${args[@]}" ;;
  packed_attention)
    add_job "packed_attention_$s$lt$tag" "$py" $bench/packed_attention.py "${pa[@]}" "${lengths_arg[@]}" "${args[@]}" ;;
  verl) add_job "verl_$s$lt$tag" "$py" $bench/verl_grpo.py "${pa[@]}" --gpus "$gpus" "${lengths_arg[@]}" "${args[@]}" ;;
  baselines) add_job "trl_$s$lt$tag" "$py" $bench/trl_grpo.py "${pa[@]}" "${lengths_arg[@]}" "${args[@]}" ;;
  vllm) add_job "vllm_check$tag" env OUT="$out/vllm_check$tag" BUDGET_S=$((timeout_s - 20)) \
    bash $bench/vllm_gpu_check.sh "${args[@]}" ;;
  vllm_cost) add_job "vllm_cost_$s$tag" "$py" $bench/vllm_sampling_cost.py "${pa[@]}" "${args[@]}" ;;
  multi_turn) add_job "multi_turn_$s$tag" "$py" $bench/multi_turn.py "${pa[@]}" "${args[@]}" ;;
  gpu_tests) add_job "gpu_tests$tag" "$py" -m pytest -q -rA -m "gpu or vllm" tests/ "${args[@]}" ;;
  two_nodes)
    ((num_lanes >= 2)) || die "two_nodes runs two one-GPU nodes side by side: --devices needs 2 GPUs, has $devices"
    for node in 0 1; do
      add_job "two_nodes_$node$tag" torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29555 --rdzv-id=two_nodes --rdzv-conf=is_host=$((node == 0)) -m engine.train \
        cluster=single_gpu parallel.tp=2 trainer.total_steps=2 data.batch_size=8 rollout.n=4 \
        trainer.micro_batch_size=4 trainer.progress_bar=false trainer.output_dir=/tmp/bench-two-nodes "${args[@]}"
    done ;;
  esac
done

lane_devices() {  # lane_devices LANE: the lane's GPU ids, comma-separated
  local ids=("${device_list[@]:$(($1 * gpus)):$gpus}")
  (IFS=,; echo "${ids[*]}")
}

install_wheels() {  # what .whl/ carries, in the order of ../shared/device/README.md (vllm, base, trl), then verl
  local kind
  for kind in vllm base trl verl; do
    [ $kind = verl ] || [ -f .whl/install-on-gpu.sh ] || continue
    case $kind in
    vllm) compgen -G ".whl/vllm/c*/*" > /dev/null || continue
      # a warm machine has it already; calls 1-3 of the recipe only stash their part (the check fails)
      if ((!dry)) && "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)"; then
        continue
      fi ;;
    verl) compgen -G ".whl/verl/c*/*" > /dev/null || continue ;;  # install_verl_on_gpu.sh: stash or install
    *) compgen -G ".whl/$kind/*.whl" > /dev/null || continue ;;
    esac
    local step=(bash .whl/install-on-gpu.sh "$kind")
    if [ $kind = verl ]; then
      step=(bash $bench/install_verl_on_gpu.sh stash)
      compgen -G ".whl/verl/c3/*" > /dev/null && step=(bash $bench/install_verl_on_gpu.sh install)
    fi
    if ((dry)); then
      echo "install: ${step[*]}"
    elif "${step[@]}" >> "$out/install.log" 2>&1; then
      echo "install $kind rc=0" >> "$out/status.txt"
    else
      echo "install $kind rc=$? (vllm: parts stashed until the last one comes; see install.log)" >> "$out/status.txt"
    fi
  done
}

run_lane() {  # run_lane LANE: the lane's jobs, one after the other
  local lane=$1 i rc
  for ((i = lane; i < ${#names[@]}; i += num_lanes)); do
    # MASTER_PORT: one-process jobs of different lanes must not meet on one rendezvous port
    eval "CUDA_VISIBLE_DEVICES=$(lane_devices "$lane") MASTER_PORT=$((29600 + lane)) \
      timeout --kill-after=10 $timeout_s ${cmds[$i]}" >> "$out/${names[$i]}.$ext" 2> "$out/${names[$i]}.err"
    rc=$?
    echo "${names[$i]} rc=$rc" >> "$out/status.txt"
  done
}

if ((dry)); then
  ((install)) && install_wheels
  for ((i = 0; i < ${#names[@]}; i++)); do
    lane=$((i % num_lanes))
    echo "job ${names[$i]} [lane $lane, GPUs $(lane_devices $lane)]: timeout $timeout_s ${cmds[$i]}> $out/${names[$i]}.$ext"
  done
  exit 0
fi

mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
# no network on the GPU machine: fail fast instead of waiting on the hub
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
((install)) && install_wheels
for ((lane = 0; lane < num_lanes && lane < ${#names[@]}; lane++)); do
  run_lane "$lane" &
done
wait
for f in "$out"/*.err; do  # one file of stderr tails (few files come back from a device call)
  [ -s "$f" ] && { echo "== $f"; tail -n 30 "$f"; } >> "$out/stderr_tails.txt"
  rm -f "$f"
done
cat "$out/status.txt"
for name in "${names[@]}"; do  # the exit status: 0 when every job of this call passed
  grep -qx "$name rc=0" "$out/status.txt" || exit 1
done
