"""Training checkpoints: the checksummed payload, saving, loading with every entry validated,
restoring into a model and optimizer, and the checks made before a run starts."""

from __future__ import annotations

import hashlib
import io
import math
import os
import reprlib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spikefuse.errors import SpikefuseError, os_reason
from spikefuse.fused import match_optimizer_state
from spikefuse.train.config import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_KEYS,
    CHECKPOINT_VERSION,
    MODEL_CONFIG_TYPES,
    CheckpointError,
    TrainConfig,
)
from spikefuse.train.files import create_temp_file, replace_file


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for each tensor or scalar in nested dicts, lists and tuples.

    ``path`` spells the way to the leaf (``model['0.weight']``); empty containers are leaves
    too, so the sequence of leaves pins down the whole structure.
    """
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)) and value:
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}[{index}]")
    else:
        yield path, value


def payload_digest(payload: dict[str, Any]) -> str:
    """Return the sha256 of a checkpoint payload's contents, its ``"sha256"`` entry excluded.

    The digest covers every entry (paths, tensor dtypes, shapes and bytes, scalars), not the
    file's bytes, so it does not depend on how torch lays out the file or which device the
    tensors came from. Raises ``ValueError`` for a leaf that no checkpoint holds.
    """
    digest = hashlib.sha256()
    content = {key: value for key, value in payload.items() if key != "sha256"}
    for path, leaf in _leaves(content, ""):
        if isinstance(leaf, torch.Tensor):
            flat = leaf.detach().cpu().contiguous().reshape(-1)
            header = f"tensor:{leaf.dtype}:{tuple(leaf.shape)}:".encode()
            data = header + flat.view(torch.uint8).numpy().tobytes()
        elif isinstance(leaf, (bool, int, float, str, type(None))):
            data = f"{type(leaf).__name__}:{leaf!r}".encode()
        elif isinstance(leaf, (dict, list, tuple)):  # empty: a dict and a sequence differ
            data = b"{}" if isinstance(leaf, dict) else b"[]"
        else:
            raise ValueError(f"{path} is a {type(leaf).__name__}")
        for part in (path.encode(), data):  # length-prefixed: no two sequences encode alike
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def first_non_finite(value: Any, path: str) -> str | None:
    """Return the path of the first NaN or infinite float or tensor in ``value``, else None."""
    for leaf_path, leaf in _leaves(value, path):
        if isinstance(leaf, torch.Tensor):
            if leaf.is_floating_point() or leaf.is_complex():
                if not bool(torch.isfinite(leaf).all()):
                    return leaf_path
        elif isinstance(leaf, float) and not math.isfinite(leaf):
            return leaf_path
    return None


def _non_finite_state(payload: dict[str, Any]) -> str | None:
    """Where the first NaN or infinity of a payload's weights or optimizer state is, if any."""
    return first_non_finite(payload["model"], "model") or first_non_finite(
        payload["optimizer"], "optimizer"
    )


def save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` plus its ``"sha256"`` digest atomically to ``path`` (or its target).

    The payload is first serialized in memory (:func:`checkpoint_bytes`), then written to a
    temporary file that is fsynced and renamed over the checkpoint: an interrupted or failed
    save never leaves a truncated file and keeps the previous checkpoint. A failed write is a
    :class:`SpikefuseError` naming the OS reason.
    """
    replace_file(path, checkpoint_bytes(path, payload), "checkpoint")


def checkpoint_bytes(path: Path, payload: dict[str, Any]) -> memoryview:
    """``payload`` plus its ``"sha256"`` digest, serialized for checkpoint ``path``. Refuses
    (:class:`SpikefuseError`) a payload holding NaN or infinity."""
    bad = _non_finite_state(payload)
    if bad is not None:
        raise SpikefuseError(
            f"not writing checkpoint '{path}' after epoch {payload['epoch']}: {bad} holds NaN "
            f"or inf, the training diverged (a smaller --lr may help); '{path}' is left "
            f"as it was"
        )
    buffer = io.BytesIO()
    torch.save({**payload, "sha256": payload_digest(payload)}, buffer)
    return buffer.getbuffer()


def _first_sentence(exc: Exception) -> str:
    # torch's messages run to paragraphs of advice; the first sentence names the problem.
    lines = str(exc).strip().split(". ")[0].splitlines()
    return lines[0] if lines else type(exc).__name__


# torch.save writes a zip archive of stored (uncompressed) entries.
ZIP_SIGNATURE = b"PK\x03\x04"
# The largest checkpoint read: far above the zoo's models with their Adam state.
MAX_CHECKPOINT_BYTES = 2**35


def archive_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a checkpoint that torch.save wrote, from its size, signature and
    zip directory alone (so that reading it allocates no more than the file holds); None when
    it can be. Raises ``OSError``."""
    size = os.stat(path).st_size
    if size > MAX_CHECKPOINT_BYTES:
        return f"it has {size} bytes, more than the {MAX_CHECKPOINT_BYTES} read"
    with open(path, "rb") as f:
        if f.read(len(ZIP_SIGNATURE)) != ZIP_SIGNATURE:
            return "it is not a zip archive, as torch.save writes"
        try:
            with zipfile.ZipFile(f) as archive:
                entries = archive.infolist()
        except (zipfile.BadZipFile, ValueError, EOFError) as exc:
            return f"its zip directory is damaged: {exc}"
    declared = sum(entry.file_size for entry in entries)
    if declared > size or any(entry.compress_type != zipfile.ZIP_STORED for entry in entries):
        return f"its entries declare {declared} bytes (or compressed ones) in {size} bytes"
    return None


def is_checkpoint_head(head: bytes) -> bool:
    """Whether ``head``, the first bytes of a file, begins a checkpoint that spikefuse
    wrote: torch's zip archive whose first entry, the pickle, starts with the format tag."""
    return head.startswith(ZIP_SIGNATURE) and CHECKPOINT_FORMAT.encode() in head


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a spikefuse training checkpoint of any version, intact or not
    (only such a file may be overwritten)."""
    try:
        if archive_problem(path) is not None:
            return False
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise SpikefuseError(f"cannot read '{path}': {os_reason(exc)}") from exc
    except Exception:
        return False
    return isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT


def load_checkpoint(path: Path, config: TrainConfig) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` and validate every entry.

    Raises :class:`CheckpointError` for a missing, empty, unreadable, foreign, other-version,
    incomplete or damaged (checksum) file, for NaN or infinite weights or optimizer state,
    for an epoch outside ``1..config.epochs`` and for a model configuration other than
    ``config``'s.
    """
    payload = _read_payload(path)
    _check_entries(payload, path, config)
    _check_config(payload, path, config)
    return payload


def _read_payload(path: Path) -> dict[str, Any]:
    """The tagged payload of checkpoint ``path``, of this version, with exactly its keys."""
    if not path.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist (drop --resume to start over)")
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' is not a regular file")
    if path.stat().st_size == 0:
        raise CheckpointError(
            f"checkpoint '{path}' is empty (0 bytes): it is not a spikefuse checkpoint"
        )
    try:
        problem = archive_problem(path)
        # weights_only: a checkpoint is data, never code to run.
        payload = None if problem else torch.load(path, map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CheckpointError(f"checkpoint '{path}' cannot be read: {os_reason(exc)}") from exc
    except Exception as exc:
        problem = _first_sentence(exc)
    if problem is not None:
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read: the file is corrupted or is not a "
            f"spikefuse checkpoint ({problem})"
        )
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"'{path}' is not a spikefuse training checkpoint (no '{CHECKPOINT_FORMAT}' tag)"
        )
    if payload.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(
            f"checkpoint '{path}' has format version {payload.get('version')!r}; this "
            f"spikefuse reads version {CHECKPOINT_VERSION} (start over with --overwrite, or "
            f"resume with the spikefuse that wrote it)"
        )
    missing = sorted(CHECKPOINT_KEYS - payload.keys())
    if missing:
        raise CheckpointError(f"checkpoint '{path}' is incomplete: no {', '.join(missing)}")
    unexpected = sorted(map(repr, payload.keys() - CHECKPOINT_KEYS))
    if unexpected:
        raise CheckpointError(f"checkpoint '{path}' has unknown entries {', '.join(unexpected)}")
    return payload


def _damaged(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint '{path}' is damaged: {what}")


def _check_entries(payload: dict[str, Any], path: Path, config: TrainConfig) -> None:
    """Check a payload's checksum, then each entry (a crafted file can match its checksum)."""

    try:
        digest = payload_digest(payload)
    except (ValueError, RuntimeError, TypeError) as exc:
        raise _damaged(path, f"it holds an unexpected value ({exc})") from exc
    if payload["sha256"] != digest:
        raise _damaged(path, "its contents do not match their sha256 checksum")
    # The checksum catches accidents; the checks below also reject a crafted file.
    epoch = payload["epoch"]
    if type(epoch) is not int or epoch < 1:
        raise _damaged(path, f"its epoch is {epoch!r}, not a whole number >= 1")
    if epoch > config.epochs:
        raise CheckpointError(
            f"checkpoint '{path}' is at epoch {epoch}, past --epochs {config.epochs} "
            f"(pass --epochs {epoch} or more)"
        )
    accuracy = payload["test_accuracy"]
    if type(accuracy) is not float or not 0.0 <= accuracy <= 1.0:
        raise _damaged(path, f"its test accuracy is {accuracy!r}, not a number in [0, 1]")
    if not isinstance(payload["model"], dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload["model"].items()
    ):
        raise _damaged(path, "its model is not a state dict of named tensors")
    if not isinstance(payload["optimizer"], dict):
        raise _damaged(path, "its optimizer state is not a dict")
    bad = _non_finite_state(payload)
    if bad is not None:
        raise CheckpointError(
            f"checkpoint '{path}' holds NaN or inf (first in {bad}): its run diverged and "
            f"cannot be resumed"
        )


def _short_repr(value: object) -> str:
    """``repr(value)``, cut short: a crafted checkpoint's value can be of any length."""
    return reprlib.repr(value)


def _check_config(payload: dict[str, Any], path: Path, config: TrainConfig) -> None:
    """Check that the checkpoint's run had ``config``'s model configuration."""

    saved = payload["config"]
    model_config = config.model_config()
    if not isinstance(saved, dict) or saved.keys() != model_config.keys():
        raise _damaged(
            path,
            f"its config is {_short_repr(saved)}, with other keys than {sorted(model_config)}",
        )
    for key, saved_value in saved.items():
        types = MODEL_CONFIG_TYPES[key]
        if type(saved_value) not in types:
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in types)
            raise _damaged(
                path,
                f"its config's {key} is {_short_repr(saved_value)}, a "
                f"{type(saved_value).__name__}; a config holds plain values ({key}: {expected})",
            )
    differences = [
        f"{key}={_short_repr(saved[key])} in the checkpoint but {value!r} now"
        for key, value in model_config.items()
        if saved[key] != value
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint '{path}' was made with a different configuration: "
            f"{'; '.join(differences)} (pass matching options to continue it, or --overwrite "
            "instead of --resume to start a new run in its place)"
        )


def restore(
    model: nn.Module, optimizer: torch.optim.Optimizer, payload: dict[str, Any], path: Path
) -> None:
    """Load a validated checkpoint payload into ``model`` and ``optimizer``."""
    try:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        match_optimizer_state(optimizer)  # fused conv weights are channels-last on CUDA
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint '{path}' does not fit the model: {exc}") from exc
    # load_state_dict checks neither the optimizer's settings nor its buffers' shapes; a
    # mismatch would change the training silently or fail only in the first step.
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            # lr: set every epoch; capturable: how this run steps (see set_capturable)
            if key not in ("lr", "capturable") and group.get(key, default) != default:
                raise CheckpointError(
                    f"checkpoint '{path}' does not fit the model: optimizer setting "
                    f"{key}={group[key]!r}, expected {default!r}"
                )
        for param in group["params"]:
            for name, buffer in optimizer.state.get(param, {}).items():
                if (
                    isinstance(buffer, torch.Tensor)
                    and buffer.dim()
                    and buffer.shape != param.shape
                ):
                    raise CheckpointError(
                        f"checkpoint '{path}' does not fit the model: optimizer {name} of "
                        f"shape {tuple(buffer.shape)} for a parameter of shape "
                        f"{tuple(param.shape)}"
                    )


def set_capturable(optimizer: torch.optim.Optimizer, capturable: bool) -> None:
    """Make a loaded optimizer step as this run does: capturable keeps Adam's step count on
    the parameters' device (CUDA graphs), otherwise on the CPU."""
    for group in optimizer.param_groups:
        group["capturable"] = capturable
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if isinstance(state.get("step"), torch.Tensor):
                device = param.device if capturable else torch.device("cpu")
                state["step"] = state["step"].to(device, torch.float32)


def prepare_checkpoint_dir(path: Path, target: Path, config: TrainConfig) -> None:
    """Check what can be checked of checkpoint ``path`` (resolved: ``target``) before taking
    its lock, and create its directory."""
    try:
        _prepare_checkpoint_dir(path, target, config)
    except OSError as exc:  # e.g. a parent directory that may not be searched
        raise SpikefuseError(f"cannot use checkpoint '{path}': {os_reason(exc)}") from exc


def _prepare_checkpoint_dir(path: Path, target: Path, config: TrainConfig) -> None:
    if target.is_dir():
        raise SpikefuseError(f"checkpoint '{path}' is a directory; pass a file path")
    if target.exists() and not target.is_file():
        raise SpikefuseError(f"checkpoint '{path}' is not a regular file")
    if config.resume and not target.exists():
        raise CheckpointError(f"checkpoint '{path}' does not exist (drop --resume to start over)")
    existing = next(p for p in target.parents if p.exists())  # the root always exists
    if not existing.is_dir():
        raise SpikefuseError(f"checkpoint '{path}': '{existing}' is a file, not a directory")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpikefuseError(
            f"cannot create the directory of checkpoint '{path}': {os_reason(exc)}"
        ) from exc


def check_checkpoint_writable(path: Path, target: Path, config: TrainConfig) -> None:
    """Under the lock: refuse to replace what must not be replaced, and make sure the
    checkpoint can be written, before any training time is spent."""
    if target.exists() and not config.resume:
        if not is_checkpoint(target):
            raise SpikefuseError(
                f"'{path}' exists and is not a spikefuse checkpoint; refusing to overwrite "
                f"it (choose another --checkpoint)"
            )
        if not config.overwrite:
            raise SpikefuseError(
                f"checkpoint '{path}' already exists; pass --resume to continue its run or "
                f"--overwrite to start a new one in its place"
            )
    fd, probe = create_temp_file(path, target, "checkpoint")
    os.close(fd)
    try:
        probe.unlink()
    except OSError as exc:
        raise SpikefuseError(f"cannot write checkpoint '{path}': {os_reason(exc)}") from exc
