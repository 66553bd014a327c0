"""Helpers shared by the tests (import them with ``from conftest import ...``), and the markers'
skips: a test marked ``@pytest.mark.gpu`` runs only where the cuda backend can run, and is skipped
elsewhere with the reason; a test marked ``@pytest.mark.slow`` runs only with ``--slow`` (what
``./dev test --all`` and CI pass), so that ``./dev test`` stays quick.
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import types
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from spikefuse.backends import unavailable_reason

# Normalised error bounds per storage dtype, (values, gradients): what a kernel computing in
# float32 from 16-bit storage may differ from the float32 reference by.
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-2),
    torch.bfloat16: (1e-2, 6e-2),
}


def _cuda_problem() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU and CuPy: PyTorch sees no CUDA GPU"
    reason = unavailable_reason("cuda", torch.empty(0, device="cuda"))
    return None if reason is None else f"needs a CUDA GPU and CuPy: {reason}"


#: Why the cuda backend cannot run here, or None where it can.
CUDA_PROBLEM = _cuda_problem()
#: Skips a test where the cuda backend cannot run (every ``gpu``-marked test gets it).
requires_cuda = pytest.mark.skipif(CUDA_PROBLEM is not None, reason=CUDA_PROBLEM or "")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        help="also run the tests marked slow (./dev test --all and CI do)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = pytest.mark.skip(reason="slow: run with --slow (./dev test --all; CI runs it)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(requires_cuda)
        if item.get_closest_marker("slow") is not None and not config.getoption("--slow"):
            item.add_marker(skip_slow)


def gen(seed: int, device: str = "cpu") -> torch.Generator:
    """A random generator seeded with ``seed`` on ``device``."""
    return torch.Generator(device=device).manual_seed(seed)


def seed_of(*parts: object) -> int:
    """A seed that is stable across runs (str hashes are randomized per process)."""
    return zlib.crc32(repr(parts).encode())


def differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Where a and b differ, NaN counting as equal to NaN (the NaN policy: a diverged neuron
    gives NaN spikes on every backend)."""
    a, b = a.float(), b.float()
    return (a != b) & ~(a.isnan() & b.isnan())


def reldiff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max|got - want| / max|want| (absolute where want is all zero), in float64, over the
    elements finite in both; inf unless the non-finite elements (NaN, ±inf) are the same in
    both, so that a NaN never passes as a small error."""
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.double(), want.double()
    finite = got.isfinite() & want.isfinite()
    if differ(got[~finite], want[~finite]).any():
        return math.inf
    got, want = got[finite], want[finite]
    if not want.numel():
        return 0.0
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    return err / scale if scale > 0 else err


def assert_close(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *, grad: bool, what: str = ""
) -> float:
    """Assert ``reldiff(got, want)`` within :data:`TOLERANCE` of storage ``dtype`` (the gradient
    bound if ``grad``); returns the error."""
    tol = TOLERANCE[dtype][1 if grad else 0]
    err = reldiff(got, want)
    assert err <= tol, f"{what or 'result'}: normalised error {err:.2e} > {tol:.0e}"
    return err


def import_script(relative: str) -> types.ModuleType:
    """The repository's script at ``relative`` (e.g. ``benchmarks/tables.py``) as a module."""
    path = Path(__file__).resolve().parents[1] / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A free TCP port on the loopback interface (for torch.distributed's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_cifar10(folder: Path, records: int, seed: int = 0) -> Path:
    """CIFAR-10's binary layout: per record a label byte, then the R, G and B planes."""
    from spikefuse.train import CIFAR10_RECORD_BYTES, CIFAR10_TEST_FILE, CIFAR10_TRAIN_FILES

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE):
        labels = rng.integers(0, 10, (records, 1), dtype=np.uint8)
        pixels = rng.integers(0, 256, (records, CIFAR10_RECORD_BYTES - 1), dtype=np.uint8)
        np.concatenate([labels, pixels], axis=1).tofile(folder / name)
    return folder


def status_worker(rank: int, port: int, folder: str, argv: list[list[str]]) -> None:
    """A torchrun rank of ``len(argv)`` running ``spikefuse train`` with ``argv[rank]``; writes
    its exit status to ``rank<r>.status`` in ``folder``."""
    from spikefuse.cli import main

    set_torchrun_environment(rank, len(argv), port)
    Path(folder, f"rank{rank}.status").write_text(str(main(["train", *argv[rank]])))


def set_torchrun_environment(rank: int, world: int, port: int) -> None:
    """What torchrun sets for rank ``rank`` of ``world`` processes on this host."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )


@pytest.fixture(autouse=True)
def recompute_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saved spikes are recomputed or packed at any size, so that the tests' small tensors run
    those paths (in use, tensors under ``recompute.RECOMPUTE_MIN_BYTES`` are saved as they
    are; test_recompute_skips_small_inputs checks that rule)."""
    from spikefuse.fused import recompute

    monkeypatch.setattr(recompute, "RECOMPUTE_MIN_BYTES", 0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on small tensors more only add contention on the
    2-core CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- the training CLI -------------------------------------------------------------------------
# A few hundred samples and two time steps: each epoch takes a fraction of a second.
SMALL = ["--limit", "200", "--batch-size", "50", "--T", "2", "--device", "cpu", "--quiet"]


def train(checkpoint: Path, *extra: str) -> int:
    """``spikefuse train`` on the SMALL run, checkpointing to ``checkpoint``; the exit status."""
    from spikefuse.cli import main  # imported when used: spawned test workers import conftest

    return main(["train", *SMALL, "--checkpoint", str(checkpoint), *extra])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint after one epoch of the SMALL run (read it, don't modify it)."""
    path = tmp_path_factory.mktemp("ckpt") / "digits.pt"
    assert train(path, "--epochs", "1") == 0
    return path


@pytest.fixture
def copy(tmp_path: Path, checkpoint: Path) -> Path:
    """A private copy of the one-epoch checkpoint (in the test's own tmp_path)."""
    path = tmp_path / "digits.pt"
    path.write_bytes(checkpoint.read_bytes())
    return path


def error_of(capsys: pytest.CaptureFixture[str], before_training: bool = False) -> str:
    """The CLI's error message, checked to be one clear line (and, if ``before_training``,
    to have come before the run printed anything)."""
    captured = capsys.readouterr()
    assert captured.err.startswith("spikefuse: error: "), captured.err
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    if before_training:
        assert captured.out == ""
    return captured.err


# Written beside digits.pt after every epoch: the per-epoch CSV log and the loss/accuracy plot.
LOGS = ["digits.pt.csv", "digits.pt.png"]


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())
