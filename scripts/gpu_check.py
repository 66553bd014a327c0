"""GPU check: runs the GPU tests (``pytest -m gpu``, tests/gpu/) and logs them.

The tests: every generated kernel variant against the reference backend (neuron x surrogate x
dtype x reset x detach_reset on awkward shapes and layouts), the channel-affine (BatchNorm-
folded) kernels, fused vs unfused models (every memory mode), the NaN/Inf policy, determinism,
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
DTYPES = ("float32", "float16", "bfloat16")


def test_suite(report: Path) -> ET.Element:
    """The <testsuite> of pytest's JUnit XML report."""
    root = ET.parse(report).getroot()
    return root if root.tag == "testsuite" else root.find("testsuite")


def outcome_counts(suite: ET.Element) -> dict[str, int]:
    """Test counts by outcome."""
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    failed, errors = int(suite.get("failures", 0)), int(suite.get("errors", 0))
    counts = {
        "passed": total - skipped - failed - errors,
        "failed": failed,
        "errors": errors,
        "skipped": skipped,
    }
    return counts


def worst_errors_by_dtype(suite: ET.Element) -> dict[str, dict[str, float]]:
    """The largest of each ``worst_*`` property the kernel-variant tests record, by the dtype
    their name carries: dtype -> {"value": ..., "grad": ..., "spike_mismatch": ...}."""
    worst: dict[str, dict[str, float]] = {}
    for case in suite.iter("testcase"):
        dtype = next((d for d in DTYPES if f"-{d}-" in case.get("name", "")), None)
        if dtype is None or not case.get("name", "").startswith("test_kernel_matches_reference"):
            continue
        for prop in case.iter("property"):
            name = prop.get("name", "")
            if name.startswith("worst_"):
                kind = worst.setdefault(dtype, {})
                kind[name[6:]] = max(kind.get(name[6:], 0.0), float(prop.get("value", "nan")))
    return worst


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
    report.unlink(missing_ok=True)  # a report from an earlier run must not count
    start = time.perf_counter()
    with log.open("w") as out:
        tee(out, f"device: {device_name()}\n$ {shlex.join(command)}\n")
        with subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as pytest:
            for line in pytest.stdout:
                tee(out, line)
        seconds = time.perf_counter() - start
        if not report.exists():  # pytest stopped before running anything (a usage error)
            status = pytest.returncode
            tee(out, f"GPU check: pytest exited with {status} before running tests; log: {log}\n")
            return 1
        suite = test_suite(report)
        for dtype, worst in worst_errors_by_dtype(suite).items():
            errors = ", ".join(f"{kind} {err:.2e}" for kind, err in worst.items())
            tee(out, f"worst normalised error vs the float32 reference, {dtype}: {errors}\n")
        counts = outcome_counts(suite)
        ok = pytest.returncode == 0 and counts["passed"] > 0
        outcome = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k == "passed")
        quick = " (quick)" if args.quick else ""
        verdict = "PASS" if ok else "FAIL"
        summary = f"GPU check on {device_name()}{quick}: {outcome} in {seconds:.0f} s: {verdict}"
        tee(out, f"{summary}; log: {log}\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
