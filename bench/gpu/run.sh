#!/usr/bin/env bash
# The GPU acceptance kit (docs/gpu.md): bash bench/gpu/run.sh [--cpu] OUTDIR [run.py options]
# Installs this checkout without network (and .whl/ from `make gpu-wheels`), then runs
# bench/gpu/run.py, which writes OUTDIR/gpu-kit.json and OUTDIR/gpu-kit.log. run.py ends within
# the budget (--budget-s, default 400 s): `timeout` ends it MARGIN_S after the budget at most.
set -euo pipefail
cpu=()
if [[ "${1:-}" == "--cpu" ]]; then cpu=(--cpu); shift; fi
if [[ $# -lt 1 ]]; then
  echo "usage: bash bench/gpu/run.sh [--cpu] OUTDIR [--budget-s S] [--steps a,b]" >&2; exit 2
fi
out=$1; shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${PYTHON:-python3}
[[ -z "${PYTHON:-}" && -x "$root/.venv/bin/python" ]] && python=$root/.venv/bin/python
mkdir -p "$out"
cd "$root"
site=$(mktemp -d "${TMPDIR:-/tmp}/salusd-kit-site.XXXXXX")  # links and wheels, not results
extra=$("$python" bench/gpu/install.py "$site" 2>>"$out/gpu-kit.log")
export PYTHONPATH="${extra:+$extra:}${PYTHONPATH:-}"
budget=400
margin=30  # MARGIN_S: run.py reports and stops its last step inside the budget
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [[ "${args[i]}" == "--budget-s" ]] && budget=${args[i+1]:-$budget}
  [[ "${args[i]}" == --budget-s=* ]] && budget=${args[i]#--budget-s=}
done
exec timeout --kill-after=10 "$(( ${budget%.*} + margin ))" "$python" bench/gpu/run.py "$out" \
  "${cpu[@]}" "$@"
