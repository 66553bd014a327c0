#!/usr/bin/env bash
# Regenerate a result set on a machine with a CUDA GPU, e.g.
#   benchmarks/run.sh benchmarks/h200
# writes e2e_{small,medium,large}.{csv,png} and neuron.{csv,png,txt} into that folder (its
# README.md stays), and the user-loop set into FOLDER/user-loop. The spikingjelly rows need
# SpikingJelly 2.0 (pip install spikingjelly==2.0.0); without it they are error rows.
set -euo pipefail
out="${1:?usage: benchmarks/run.sh FOLDER (e.g. benchmarks/h200)}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "$out" in /*) ;; *) out="$OLDPWD/$out" ;; esac
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
for model in small medium large; do
    python3 -m spikefuse bench e2e --model "$model" --iters 30 --out "$out" --loop bench \
        --variants ann vanilla spikingjelly spikefuse fused fused+graph fused+compile
done
# A SpikingJelly-style loop left as written (repeat over T, loss.item() each step): eager,
# spikefuse.graph_model, the whole step captured; reduce-overhead on the medium network.
user=(spikingjelly spikefuse spikefuse+model-graphs fused fused+model-graphs fused+graph fused-min
      fused-min+model-graphs fused-min+graph)
python3 -m spikefuse bench e2e --model medium --iters 15 --out "$out/user-loop" --loop user \
    --variants "${user[@]}" fused+reduce-overhead
for model in sew-resnet18 spiking-resnet18; do
    python3 -m spikefuse bench e2e --model "$model" --iters 12 --out "$out/user-loop" \
        --loop user --variants "${user[@]}"
done
python3 -m spikefuse bench neuron --T 8 32 --iters 100 --out "$out"
