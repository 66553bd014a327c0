"""The per-epoch training log (CSV) and plot (PNG) beside a checkpoint."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

from spikefuse.errors import SpikefuseError, os_reason
from spikefuse.extras import require
from spikefuse.train.config import NEEDS_PLOT, TRAIN, TrainConfig
from spikefuse.train.files import checkpoint_target, replace_file

LOG_HEADER = "epoch,train_loss,test_accuracy,seconds"
PLOT_MARKER = b"spikefuse training plot"  # in the PNG's Software text chunk: marks it as ours
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The most bytes of a CSV log a resumed run reads: a row takes under 60 bytes.
MAX_LOG_BYTES = 2**26


def log_paths(target: Path) -> tuple[Path, Path]:
    """The per-epoch CSV log and the loss/accuracy plot (PNG) beside checkpoint ``target``:
    its whole name with ``.csv`` / ``.png`` added (``digits.pt.csv``), so that checkpoints
    sharing a stem (``a.pt``, ``a.ckpt``) never share a log."""
    return target.with_name(f"{target.name}.csv"), target.with_name(f"{target.name}.png")


def _is_our_log(path: Path) -> bool:
    """Whether ``path`` holds a training log or plot that spikefuse wrote (only such a file
    may be replaced)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as exc:
        raise SpikefuseError(f"cannot read '{path}': {os_reason(exc)}") from exc
    return is_plot_head(head) if path.suffix == ".png" else is_log_head(head)


def is_log_head(head: bytes) -> bool:
    """Whether ``head``, the first bytes of a file, begins a training log spikefuse wrote."""
    return head.split(b"\n", 1)[0].decode(errors="replace").strip() == LOG_HEADER


def is_plot_head(head: bytes) -> bool:
    """Whether ``head``, the first bytes of a file, begins a training plot spikefuse wrote."""
    return head.startswith(PNG_SIGNATURE) and PLOT_MARKER in head


def check_logs_writable(target: Path, config: TrainConfig) -> None:
    """Under the lock, with the checkpoint checked: the log and plot beside checkpoint
    ``target`` follow its rules. Another kind of file is never replaced; an existing log
    needs ``--resume`` (continued) or ``--overwrite`` (replaced)."""
    for path in log_paths(target):
        resolved = checkpoint_target(path)
        if resolved == target:
            raise SpikefuseError(  # a symbolic link where the log goes, to the checkpoint
                f"checkpoint '{config.checkpoint}' would be overwritten by its own training "
                f"log or plot ('{path}' leads to it); remove that link"
            )
        if not resolved.exists():
            continue
        if not resolved.is_file() or not _is_our_log(resolved):
            raise SpikefuseError(
                f"'{path}' exists and is not a spikefuse training log or plot; refusing to "
                f"overwrite it (move it away or choose another --checkpoint)"
            )
        if not (config.resume or config.overwrite):
            # --resume needs the run's checkpoint too: without it only --overwrite can start
            resume = "pass --resume to continue its run or " if target.exists() else ""
            raise SpikefuseError(
                f"training log '{path}' already exists; {resume}pass --overwrite to start a new "
                "run in its place"
            )


@dataclass
class TrainingLog:
    """The per-epoch log beside a checkpoint ``<name>``: ``<name>.csv`` (epoch, train loss, test
    accuracy, seconds) and ``<name>.png`` (loss and accuracy over the epochs), each rewritten
    atomically.

    After every epoch the CSV is written before the checkpoint and the plot after it, so that
    at every instant an interrupt can land the CSV holds a row for every epoch the checkpoint
    has (perhaps one more, of an epoch whose checkpoint was not kept). A resumed run keeps the
    rows up to the checkpoint's epoch, refuses a log that lacks one of them, and rewrites the
    CSV and plot to match the checkpoint before training (:meth:`repair`)."""

    checkpoint: Path
    resumed_epoch: int
    rows: list[tuple[int, float, float, float]] = field(default_factory=list)

    @property
    def csv_path(self) -> Path:
        return log_paths(self.checkpoint)[0]

    @property
    def png_path(self) -> Path:
        return log_paths(self.checkpoint)[1]

    def load(self) -> None:
        """Read the rows of a resumed run, up to its checkpoint's epoch (later ones belong to
        epochs whose checkpoint was not kept); none when the run starts over or has no log.
        Raises :class:`SpikefuseError` for a damaged log or one that lacks an epoch."""
        if not self.resumed_epoch or not self.csv_path.exists():
            return
        for number, line in enumerate(self._lines()[1:], start=2):
            try:
                epoch, loss, accuracy, seconds = line.split(",")
                row = (int(epoch), float(loss), float(accuracy), float(seconds))
            except ValueError:
                raise SpikefuseError(
                    f"training log '{self.csv_path}' is damaged: line {number} is {line!r}, not "
                    f"{LOG_HEADER}; move it away to resume"
                ) from None
            if row[0] <= self.resumed_epoch:
                self.rows.append(row)
        epochs = [row[0] for row in self.rows]
        if epochs != list(range(1, self.resumed_epoch + 1)):
            missing = sorted(set(range(1, self.resumed_epoch + 1)) - set(epochs))
            problem = f"has no row for epochs {missing}" if missing else "repeats or reorders rows"
            raise SpikefuseError(
                f"training log '{self.csv_path}' {problem}, but checkpoint '{self.checkpoint}' "
                f"is at epoch {self.resumed_epoch}; resuming would lose those rows: restore the "
                "log, or move it away to log from the next epoch on"
            )

    def _lines(self) -> list[str]:
        """The CSV's lines; a file over MAX_LOG_BYTES is refused unread."""
        limit = MAX_LOG_BYTES
        try:
            with open(self.csv_path, "rb") as f:
                data = f.read(limit + 1)
        except OSError as exc:
            raise SpikefuseError(f"cannot read training log '{self.csv_path}': {exc}") from exc
        if len(data) > limit:
            raise SpikefuseError(
                f"training log '{self.csv_path}' is larger than {limit} bytes, more than a "
                "million epochs' rows; it is not a log spikefuse wrote: move it away to resume"
            )
        try:
            return data.decode().splitlines()
        except UnicodeDecodeError as exc:
            raise SpikefuseError(f"cannot read training log '{self.csv_path}': {exc}") from exc

    def add(self, epoch: int, loss: float, accuracy: float, seconds: float) -> None:
        """Add an epoch's row and rewrite the CSV (the plot follows with :meth:`plot`)."""
        self.rows.append((epoch, loss, accuracy, seconds))
        self.write_csv()

    def write_csv(self) -> None:
        text = "".join(f"{e},{lo:.6g},{a:.6g},{s:.3f}\n" for e, lo, a, s in self.rows)
        replace_file(self.csv_path, f"{LOG_HEADER}\n{text}".encode(), "training log")

    def plot(self) -> None:
        """Rewrite the plot from the rows."""
        replace_file(self.png_path, self._plot(), "training plot")

    def repair(self) -> None:
        """Make a resumed run's CSV and plot match its checkpoint: rows of epochs whose
        checkpoint was not kept are removed, and a plot an interrupt left behind is redrawn."""
        if self.rows:
            self.write_csv()
            self.plot()

    def _plot(self) -> bytes:
        require(TRAIN, "demo", NEEDS_PLOT)
        # Figure, not pyplot: no global figure state and no GUI backend (PNG renders with Agg).
        from matplotlib.figure import Figure

        epochs = [row[0] for row in self.rows]
        figure = Figure(figsize=(8, 3.2))
        loss_axes, accuracy_axes = figure.subplots(1, 2)
        loss_axes.plot(epochs, [row[1] for row in self.rows], marker="o")
        loss_axes.set(xlabel="epoch", ylabel="train loss", title=self.checkpoint.name)
        accuracy_axes.plot(epochs, [row[2] for row in self.rows], marker="o", color="C1")
        accuracy_axes.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
        for axes in (loss_axes, accuracy_axes):
            axes.grid(alpha=0.3)
            axes.xaxis.get_major_locator().set_params(integer=True)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": PLOT_MARKER.decode()})
        return buffer.getvalue()
