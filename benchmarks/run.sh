#!/usr/bin/env bash
# Regenerate a result set on a machine with a CUDA GPU, e.g.
#   benchmarks/run.sh benchmarks/h200
# writes e2e_{small,medium,large}.{csv,png} and neuron.{csv,png,txt} into that folder (its
# README.md stays).
set -euo pipefail
out="${1:?usage: benchmarks/run.sh FOLDER (e.g. benchmarks/h200)}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "$out" in /*) ;; *) out="$OLDPWD/$out" ;; esac
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for model in small medium large; do
    python3 -m spikefuse bench e2e --model "$model" --iters 30 --out "$out" \
        --variants ann vanilla spikefuse fused fused+graph fused+compile
done
python3 -m spikefuse bench neuron --T 8 32 --iters 100 --out "$out"
