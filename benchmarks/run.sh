#!/usr/bin/env bash
# Regenerate a result set on a machine with a CUDA GPU, e.g.
#   benchmarks/run.sh benchmarks/h200
# writes e2e_{small,medium,large}.{csv,png} and neuron.{csv,png,txt} into that folder (its
# README.md stays), the user-loop set into FOLDER/user-loop, the residual networks into
# FOLDER/zoo and their kernel and memory profiles into FOLDER/profile. The spikingjelly rows need
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
# The residual networks at 224² (ResNet-19 at 32²), the spiking transformers at 32², and where
# the 224² step's time and memory go.
for model in sew-resnet18 spiking-resnet18 sew-resnet34 spiking-resnet34 resnet19 \
    spikformer-4-384-cifar qkformer-10-384-cifar sdt-2-512-cifar; do
    python3 -m spikefuse bench e2e --model "$model" --iters 12 --out "$out/zoo" --loop bench \
        --variants vanilla spikingjelly spikefuse fused fused-min fused+graph fused-min+graph
done
mkdir -p "$out/profile"
for model in sew-resnet18 spiking-resnet18; do
    python3 benchmarks/profile_e2e.py --model "$model" --variants fused --rows 40 \
        >"$out/profile/$model-kernels.txt"
    python3 benchmarks/profile_e2e.py --model "$model" --variants fused --dtypes fp32 --memory \
        >"$out/profile/$model-memory.txt"
done
python3 -m spikefuse bench neuron --T 8 32 --iters 100 --out "$out"
