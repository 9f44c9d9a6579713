#!/usr/bin/env bash
# Stand-ins for SLURM's `srun` and `scontrol` on one machine, to rehearse scripts/slurm/train.sbatch (tests
# link this file as bin/srun and bin/scontrol). Every "node" is this machine.
#   srun [--nodes=N] [--ntasks-per-node=M] [other options, ignored] cmd...: starts N*M local tasks with the
#     variables srun sets (SLURM_STEP_ID, SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURM_NTASKS,
#     SLURM_STEP_TASKS_PER_NODE), waits for all and exits with the last failure, like --kill-on-bad-exit=0.
#     FAKE_SLURM_GPUS_PER_NODE=g gives node i the GPUs i*g .. i*g+g-1 (CUDA_VISIBLE_DEVICES), for a GPU rehearsal.
#   scontrol show hostnames LIST: one host per line (parallel/launch.py's parser).
set -u
if [ "$(basename "$0")" = scontrol ]; then
  exec "${PYTHON:-python}" -c 'import sys; from parallel.launch import parse_nodelist
print(*parse_nodelist(sys.argv[1]), sep="\n")' "$3"
fi
nodes=${SLURM_JOB_NUM_NODES:-1}
per_node=1
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
  case $1 in
  --nodes=*) nodes=${1#*=} ;;
  --ntasks-per-node=*) per_node=${1#*=} ;;
  esac
  shift
done
pids=()
for ((node = 0; node < nodes; node++)); do
  gpus=${FAKE_SLURM_GPUS_PER_NODE:-}
  if [ -n "$gpus" ]; then
    export CUDA_VISIBLE_DEVICES=$(seq -s, $((node * gpus)) $((node * gpus + gpus - 1)))
  fi
  for ((local = 0; local < per_node; local++)); do
    SLURM_STEP_ID=0 SLURM_NODEID=$node SLURM_LOCALID=$local SLURM_PROCID=$((node * per_node + local)) \
      SLURM_NTASKS=$((nodes * per_node)) SLURM_STEP_TASKS_PER_NODE="$per_node(x$nodes)" "$@" &
    pids+=($!)
  done
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || rc=$?
done
exit $rc
