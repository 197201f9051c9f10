# Sourced by run_pretrain.sh and run_slurm_pretrain.sh: what EXP names. An existing file is
# the experiment itself; anything else is the name of a shipped experiment, taken from a
# Primus path's file name, Primus's model names mapped to Tessera's.
resolve_experiment() {
  local exp=${1:-}
  if [[ -z "$exp" ]]; then
    echo "error: EXP must name an experiment (e.g. EXP=llama3.1_8B-pretrain), as in Primus" >&2
    exit 2
  fi
  EXTRA_ARGS=()
  if [[ -f "$exp" ]]; then
    CONFIG=$exp
    return
  fi
  local name
  name=$(basename "$exp")
  name=${name%.yaml}
  name=${name%.yml}
  name=${name/_v0.1/}  # Primus's mixtral_8x7B_v0.1
  case "$name" in
    *-BF16-pretrain) name=${name%-BF16-pretrain}-pretrain ;;
    *-FP8-pretrain) name=${name%-FP8-pretrain}-pretrain; EXTRA_ARGS=(--fp8 hybrid) ;;
  esac
  CONFIG=$name
}
