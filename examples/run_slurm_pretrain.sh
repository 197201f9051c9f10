#!/bin/bash
# Pretraining on NNODES nodes of a Slurm allocation, typed as Primus users type it:
#
#   EXP=llama3.3_70B-pretrain NNODES=8 bash examples/run_slurm_pretrain.sh --micro_batch_size 4 \
#       --global_batch_size 256 --recompute_num_layers 80 --fp8 hybrid
#
# srun starts one `tessera train` per GPU; each reads its rank from Slurm (SLURM_PROCID, ...)
# and rank 0's host from the node list (docs/distributed.md). EXP and the arguments are as for
# run_pretrain.sh. Environment: NNODES (1), GPUS_PER_NODE (8), MASTER_PORT (derived from the
# job id when unset), CPUS_PER_TASK (16), TESSERA (the binary, default build/tessera).
set -euo pipefail

if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TESSERA=${TESSERA:-$ROOT/build/tessera}
source "$ROOT/examples/experiment_name.sh"
resolve_experiment "${EXP:-}"  # sets CONFIG and EXTRA_ARGS; exits 2 without one

NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
echo "experiment: $CONFIG${EXTRA_ARGS:+ (${EXTRA_ARGS[*]})}; $NNODES node(s) x $GPUS_PER_NODE GPUs"
exec srun --nodes "$NNODES" --ntasks-per-node "$GPUS_PER_NODE" --gpus-per-node "$GPUS_PER_NODE" \
  --cpus-per-task "${CPUS_PER_TASK:-16}" --kill-on-bad-exit=1 --cpu-bind=none \
  "$TESSERA" train --config "$CONFIG" "${EXTRA_ARGS[@]}" "$@"
