"""GPU check: runs the GPU tests (``pytest -m gpu``, tests/gpu/) and logs them.

The tests: every generated kernel variant against the reference backend (neuron x surrogate x
dtype x reset x detach_reset on awkward shapes and layouts), the channel-affine (BatchNorm-
folded) kernels, fused vs unfused models (both memory modes), the NaN/Inf policy, determinism,
placement on a second GPU, register use, CUDA-graph replay and torch.compile vs eager, and
``spikefuse train`` on the GPU.

Usage: python scripts/gpu_check.py [--quick] [--out DIR] [PYTEST_ARGS...]
  --quick      only the tests marked ``quick`` (LIF and Izhikevich, two surrogates, every extra)
  --out DIR    where the log (gpu_check.log: pytest's output with a line per test) and the JUnit
               XML report (gpu_check.xml: per-test times and recorded errors) go
  PYTEST_ARGS  passed on to pytest, e.g. ``-k graphs`` or ``-x``
Prints a one-line summary last. Exit status 0 when every selected test passed (and at least one
ran), else 1.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]


def summary(report: Path) -> tuple[dict[str, int], float]:
    """(test counts by outcome, seconds) from pytest's JUnit XML report."""
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed, errors = int(suite.get("failures", 0)), int(suite.get("errors", 0))
    counts = {
        "passed": total - skipped - failed - errors,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
    }
    return counts, float(suite.get("time", 0.0))


def tee(log: TextIO, text: str) -> None:
    """Write ``text`` to the terminal and the log."""
    sys.stdout.write(text)
    sys.stdout.flush()
    log.write(text)


def device_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return (
        f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="only the tests marked 'quick'")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    args, pytest_args = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    log, report = args.out / "gpu_check.log", args.out / "gpu_check.xml"
    marker = "gpu and quick" if args.quick else "gpu"
    command = [sys.executable, "-m", "pytest", str(ROOT / "tests"), "-m", marker, "-q", "-rA"]
    command += [f"--junitxml={report}", "-p", "no:cacheprovider", *pytest_args]
    start = time.perf_counter()
    with log.open("w") as out:
        tee(out, f"device: {device_name()}\n$ {shlex.join(command)}\n")
        with subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as pytest:
            for line in pytest.stdout:
                tee(out, line)
        status = pytest.returncode
    seconds = time.perf_counter() - start
    if not report.exists():  # pytest stopped before running anything (a usage error)
        print(f"GPU check: pytest exited with status {status} before running tests; log: {log}")
        return 1
    counts, _ = summary(report)
    ok = status == 0 and counts["passed"] > 0
    outcome = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k == "passed")
    print(
        f"GPU check on {device_name()}{' (quick)' if args.quick else ''}: {outcome} in "
        f"{seconds:.0f} s: {'PASS' if ok else 'FAIL'}; log: {log}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
