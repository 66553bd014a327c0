"""``spikefuse train``'s command line: the parser and the entry point."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from spikefuse.errors import SpikefuseError
from spikefuse.fused import memory_modes
from spikefuse.train.config import (
    AMP_MODES,
    BACKENDS,
    CUDA_GRAPH_MODES,
    DATA_SETS,
    DEVICES,
    DIGITS_SAMPLES,
    MAX_SEED,
    MIN_SAMPLES,
    MODELS,
    NEURONS,
    TrainConfig,
)
from spikefuse.train.loop import run


def build_parser() -> argparse.ArgumentParser:
    """Return the parser for ``spikefuse train``; its defaults are :class:`TrainConfig`'s.

    Values are range-checked by :class:`TrainConfig` (see :func:`main`).
    """
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog="spikefuse train",
        description="Train a spiking network: by default a small CNN on scikit-learn's 8x8 "
        "digits; under torchrun with DistributedDataParallel. Writes a checkpoint, and beside it "
        "a per-epoch CSV log and a loss/accuracy plot (PNG) of the same name.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _add_model_options(p, d)
    _add_data_options(p, d)
    _add_run_options(p, d)
    return p


def _add_model_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The network, its neurons and how they run."""
    p.add_argument("--epochs", type=int, default=d.epochs, help="total epochs")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="training batch")
    p.add_argument("--T", type=int, default=d.T, help="time steps per sample")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate, cosine-decayed")
    p.add_argument(
        "--model",
        choices=list(MODELS),
        default=d.model,
        help="network: the digits CNN or a spikefuse.models network (10 classes)",
    )
    p.add_argument("--neuron", choices=sorted(NEURONS), default=d.neuron, help="neuron model")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=d.backend,
        help="neuron backend; auto lets each neuron pick the fastest available",
    )
    p.add_argument("--device", choices=DEVICES, default=d.device, help="auto: cuda if available")


def _add_data_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The data, fusion and precision."""
    p.add_argument(
        "--data",
        choices=list(DATA_SETS),
        default=d.data,
        help="digits: scikit-learn's, built in; cifar10 and the neuromorphic sets "
        "(dvs128-gesture, cifar10-dvs, n-mnist, shd: --T frames per sample): read from "
        "--data-dir",
    )
    p.add_argument(
        "--data-dir",
        default=d.data_dir,
        metavar="PATH",
        help="CIFAR-10's binary version (cifar-10-batches-bin: data_batch_1..5.bin, "
        "test_batch.bin), or a neuromorphic set's root folder as spikingjelly.datasets "
        "takes it (download/ with the published files, extract/ or events_np/)",
    )
    p.add_argument(
        "--fuse",
        action="store_true",
        help="train with fused Conv/Linear -> BatchNorm -> neuron blocks (spikefuse.fuse)",
    )
    p.add_argument(
        "--memory",
        choices=memory_modes(),
        default=d.memory,
        help="with --fuse: 'min' keeps only each block's (1-bit packed) input and recomputes "
        "its Conv/Linear in backward; 'auto' does so in the blocks where it pays",
    )
    p.add_argument(
        "--amp",
        choices=AMP_MODES,
        default=d.amp,
        help="bf16: run the forward under bf16 autocast (CPU or CUDA)",
    )
    p.add_argument(
        "--seed", type=int, default=d.seed, help=f"0..{MAX_SEED}; seeds the split, init, batches"
    )


def _add_run_options(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The checkpoint and how the run starts and reports."""
    p.add_argument(
        "--checkpoint",
        default=d.checkpoint,
        metavar="PATH",
        help="written after every epoch; locked while the run lasts",
    )
    existing = p.add_mutually_exclusive_group()
    existing.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    existing.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, replacing an existing --checkpoint (never a file of another kind)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=d.limit,
        metavar="N",
        help=f"use only N samples (smoke tests): digits {MIN_SAMPLES}..{DIGITS_SAMPLES}; "
        "cifar10 N training and up to N test samples",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    graphs = p.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graph",
        nargs="?",
        const="step",
        default=d.cuda_graph,
        choices=CUDA_GRAPH_MODES,
        metavar="MODE",
        help="CUDA graphs: 'model' replays the model's forward and backward, 'step' (the "
        "default without MODE) the whole training step; 'auto' (default) is model on a GPU",
    )
    graphs.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_const",
        const="off",
        help="run every step eagerly (same as --cuda-graph off)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``spikefuse train`` entry point; returns the exit status.

    An invalid option value exits with status 2 and a usage message, before anything runs.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**vars(args))
    except SpikefuseError as exc:
        parser.error(str(exc))
    run(config)
    return 0
