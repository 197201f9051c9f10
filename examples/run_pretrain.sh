#!/bin/bash
# Pretraining on the GPUs of this node (or, with NNODES, of this node's share of a multi-node
# job), typed as Primus users type it:
#
#   EXP=llama3.1_8B-pretrain bash examples/run_pretrain.sh --train_iters 50 --fp8 hybrid
#   EXP=examples/megatron/configs/MI300X/llama3.1_8B-pretrain.yaml bash examples/run_pretrain.sh
#
# EXP is an experiment file, or the name of a shipped one (configs/experiments/): a Primus path
# that is not on disk is taken by its name, Primus's model names mapped to Tessera's
# (mixtral_8x7B_v0.1 -> mixtral_8x7B; a -BF16 suffix dropped, -FP8 adds --fp8 hybrid). The
# arguments are training keys (`tessera train --help`), passed on unchanged. Environment, as
# Primus's script reads it: NNODES (1), NODE_RANK (0), GPUS_PER_NODE (8), MASTER_ADDR
# (localhost), MASTER_PORT (1234); TESSERA: the binary (default build/tessera beside this
# folder).
set -euo pipefail

if [[ "${1:-}" == "--help" || "${1:-}" == "-h" ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TESSERA=${TESSERA:-$ROOT/build/tessera}
source "$ROOT/examples/experiment_name.sh"
resolve_experiment "${EXP:-}"  # sets CONFIG and EXTRA_ARGS; exits 2 without one

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-1234}

if [[ "$NODE_RANK" == 0 ]]; then
  echo "experiment: $CONFIG${EXTRA_ARGS:+ (${EXTRA_ARGS[*]})}; $NNODES node(s) x $GPUS_PER_NODE GPUs," \
    "master $MASTER_ADDR:$MASTER_PORT"
fi
exec "$TESSERA" launch --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  train --config "$CONFIG" "${EXTRA_ARGS[@]}" "$@"
