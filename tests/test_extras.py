"""Optional dependencies: the library imports without the demo's and benchmarks' packages, and
a command that needs a missing one stops before it starts, naming the extra that installs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import spikefuse
from spikefuse import train as train_module
from spikefuse.cli import main
from spikefuse.extras import MissingExtraError, require

OPTIONAL = ("sklearn", "matplotlib", "tqdm")

# Run first in a subprocess: every import of an OPTIONAL package (or of one of its submodules)
# fails as if it were not installed, and is recorded in `Blocker.attempts`.
BLOCKER = f"""
import sys

class Blocker:
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {OPTIONAL!r}:
            Blocker.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` after :data:`BLOCKER` in a fresh interpreter on this checkout's sources."""
    env = {**os.environ, "PYTHONPATH": str(Path(spikefuse.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def block_optional(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Make ``import name`` fail in this process, as for a package that is not installed."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_importing_spikefuse_and_its_apps_needs_no_optional_package() -> None:
    done = run_blocked(
        "import torch\n"
        "Blocker.attempts.clear()  # torch.hub tries tqdm itself, with a fallback\n"
        "import spikefuse, spikefuse.cli, spikefuse.train, spikefuse.extras\n"
        "import spikefuse.bench.e2e, spikefuse.bench.neuron\n"
        f"loaded = [m for m in sys.modules if m.partition('.')[0] in {OPTIONAL!r}]\n"
        "print('attempts', Blocker.attempts, 'loaded', loaded)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "attempts [] loaded []"


def test_train_help_works_without_optional_packages() -> None:
    done = run_blocked("from spikefuse.cli import main\nsys.exit(main(['train', '--help']))\n")
    assert done.returncode == 0, done.stderr
    assert "usage: spikefuse train" in done.stdout


def test_training_the_digits_without_the_demo_extra_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block_optional(monkeypatch, *OPTIONAL)
    checkpoint = tmp_path / "digits.pt"
    args = ["--epochs", "1", "--limit", "50", "--device", "cpu", "--checkpoint", str(checkpoint)]
    assert main(["train", *args]) == 1
    message = capsys.readouterr().err
    assert message.startswith("spikefuse: error: spikefuse train needs packages that cannot")
    for package in ("scikit-learn for the digits data set", "matplotlib for the training plot"):
        assert package in message
    assert "tqdm for the progress bar (or pass --quiet)" in message
    assert message.rstrip().endswith("Install them with: pip install 'spikefuse[demo]'")
    assert list(tmp_path.iterdir()) == []  # stopped before the lock, checkpoint or log
    # The same as an exception, for a program that calls run().
    config = train_module.TrainConfig(checkpoint=str(checkpoint), limit=50, device="cpu")
    with pytest.raises(MissingExtraError, match=r"pip install 'spikefuse\[demo\]'"):
        train_module.run(config)


def test_a_run_asks_only_for_the_packages_it_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    block_optional(monkeypatch, *OPTIONAL)
    config = train_module.TrainConfig(
        checkpoint=str(tmp_path / "c.pt"), data="cifar10", data_dir=str(tmp_path), quiet=True
    )
    with pytest.raises(MissingExtraError) as error:
        train_module.run(config)
    assert "matplotlib" in str(error.value)
    assert "scikit-learn" not in str(error.value) and "tqdm" not in str(error.value)
    assert train_module.optional_needs(config) == {"matplotlib": "the training plot"}


def test_loading_the_digits_without_scikit_learn_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    block_optional(monkeypatch, "sklearn")
    with pytest.raises(MissingExtraError, match=r"scikit-learn .*spikefuse\[demo\]"):
        train_module.load_digits_split(seed=0)


def test_benchmarks_without_matplotlib_stop_before_measuring(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block_optional(monkeypatch, "matplotlib")
    assert main(["bench", "e2e", "--device", "cpu", "--iters", "1"]) == 1
    captured = capsys.readouterr()
    assert "pip install 'spikefuse[bench]'" in captured.err
    assert "e2e medium" not in captured.out  # nothing was measured


def test_require_passes_when_installed_and_names_each_missing_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    require("x", "demo", {"math": "arithmetic"})  # importable: no error
    block_optional(monkeypatch, "tqdm")
    with pytest.raises(MissingExtraError) as error:
        require("spikefuse thing", "extra", {"math": "arithmetic", "tqdm": "progress"})
    message = str(error.value)
    assert message.startswith("spikefuse thing needs packages that cannot be imported: tqdm ")
    assert "math" not in message and message.endswith("pip install 'spikefuse[extra]'")
