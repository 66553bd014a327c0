"""Command line interface: ``spikefuse train ...`` and ``spikefuse bench {neuron,e2e} ...``.

Subcommand modules are imported only when their subcommand runs, so ``--help`` is quick and
one subcommand works even while another's dependencies are missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from spikefuse.errors import SpikefuseError

BENCHMARKS = {
    "neuron": "spikefuse.bench.neuron",
    "e2e": "spikefuse.bench.e2e",
}


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser; subcommand options are parsed by the subcommand itself."""
    parser = argparse.ArgumentParser(
        prog="spikefuse", description="Fast, memory-lean spiking neural network training."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Train's own parser (in spikefuse.train) reads its options. A prefix other than "-" keeps
    # argparse from taking them as options here, so REMAINDER hands over all of them in order,
    # `--help` included.
    train = sub.add_parser(
        "train",
        help="train a spiking network (scikit-learn's digits by default; CIFAR-10, neuromorphic sets)",
        prefix_chars="+",
        add_help=False,
    )
    train.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    bench = sub.add_parser("bench", help="run a benchmark (see `spikefuse bench NAME --help`)")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the benchmark")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return the process exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from spikefuse import train

            return train.main(args.args)
        module_name = BENCHMARKS[args.name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not (module_name + ".").startswith(exc.name + "."):
                raise  # a dependency of the benchmark is missing: show the real error
            raise SpikefuseError(
                f"benchmark {args.name!r} is not part of this installation ({exc.name})"
            ) from exc
        return module.main(args.args) or 0
    except SpikefuseError as exc:
        print(f"spikefuse: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spikefuse: interrupted", file=sys.stderr)
        return 130
