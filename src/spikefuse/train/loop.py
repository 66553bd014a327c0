"""The training loop: set up, train epoch by epoch, evaluate, checkpoint and log; under
``torchrun`` with DistributedDataParallel."""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spikefuse import backends, functional
from spikefuse.errors import BackendUnavailableError, SpikefuseError
from spikefuse.extras import require
from spikefuse.fused import fuse
from spikefuse.graphs import GraphedStep
from spikefuse.model_graphs import graph_model
from spikefuse.train.checkpoint import (
    check_checkpoint_writable,
    checkpoint_bytes,
    is_checkpoint_head,
    load_checkpoint,
    prepare_checkpoint_dir,
    restore,
    set_capturable,
)
from spikefuse.train.config import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    CLASSES,
    EVAL_BATCH_SIZE,
    MODELS,
    NEEDS_DIGITS,
    NEEDS_PLOT,
    NEEDS_PROGRESS,
    NEURONS,
    TRAIN,
    TrainConfig,
)
from spikefuse.train.data import Dataset, load_data
from spikefuse.train.files import (
    checkpoint_lock,
    checkpoint_target,
    remove_stale_temp_files,
    replace_file,
)
from spikefuse.train.logs import (
    TrainingLog,
    check_logs_writable,
    is_log_head,
    is_plot_head,
    log_paths,
)
from spikefuse.train.ranks import (
    ONE_PROCESS,
    Ranks,
    agree,
    agree_on_work,
    epoch_order,
    ranks_from_env,
)


def build_network(config: TrainConfig, data: Dataset) -> tuple[nn.Module, Dataset]:
    """``config.model`` for ``data``'s images, and ``data`` with the channels it needs."""
    spec = MODELS[config.model]
    if spec.channels is not None:
        data = data.with_channels(spec.channels)
    make_neuron = functools.partial(NEURONS[config.neuron], backend=config.backend)
    channels, size = data.x_train.shape[-3], data.x_train.shape[-1]
    return spec.build(make_neuron, channels, size, CLASSES[config.data]), data


def forward(
    model: nn.Module, images: torch.Tensor, T: int, amp: str = "none", graphed: bool = False
) -> torch.Tensor:
    """Direct encoding: feed the same image at each of the T steps (a view, ``expand``: the
    first synapse then runs once per image), or a sequence of frames ``[N, T, C, H, W]`` step
    by step; return ``[N, classes]`` (float32).
    ``amp="bf16"`` runs the model under bf16 autocast (CPU or CUDA); ``graphed``: the call is
    captured into a CUDA graph, where autocast must not cache its weight casts."""
    with torch.autocast(
        images.device.type, torch.bfloat16, enabled=amp == "bf16", cache_enabled=not graphed
    ):
        steps = (
            images.transpose(0, 1)
            if images.dim() == 5
            else images.unsqueeze(0).expand(T, *images.shape)
        )
        logits = model(steps).mean(0)
    functional.reset_net(model)  # the next batch starts from resting neurons
    return logits.float()


def resolve_device(name: str) -> torch.device:
    """Map ``auto`` to CUDA when PyTorch sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SpikefuseError("--device cuda: PyTorch sees no CUDA GPU")
    return torch.device(name)


@contextlib.contextmanager
def cpu_threads(device: torch.device, count: int) -> Iterator[None]:
    """Limit torch's intra-op CPU threads while training on the CPU.

    The digits network's ops are too small to gain from threads, and spinning OpenMP threads
    slow down many times over when other processes share the cores. A fixed count also makes
    the results independent of the machine's core count.
    """
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def describe_backend(backend: str, device: torch.device) -> str:
    """Say which neuron backend will run on ``device``; fail early if an explicit one cannot."""
    probe = torch.empty(0, device=device)
    if backend != "auto":
        reason = backends.unavailable_reason(backend, probe)
        if reason is not None:
            raise BackendUnavailableError(f"--backend {backend}: {reason}")
        return backend
    chosen = backends.resolve("auto", probe)
    if chosen == "cuda" or device.type != "cuda":
        return f"auto -> {chosen}"
    # On a GPU the user likely expected cuda, so say why it is not used.
    return f"auto -> torch ({backends.unavailable_reason('cuda', probe)})"


@torch.no_grad()
def evaluate(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, T: int, amp: str = "none"
) -> float:
    """Return the classification accuracy on ``images``."""
    model.eval()
    correct = 0
    for start in range(0, len(labels), EVAL_BATCH_SIZE):
        logits = forward(model, images[start : start + EVAL_BATCH_SIZE], T, amp)
        correct += int((logits.argmax(1) == labels[start : start + EVAL_BATCH_SIZE]).sum())
    return correct / len(labels)


TrainStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (images, labels) -> loss


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig, graphed: bool = False
) -> TrainStep:
    """One optimisation step on a batch, returning its loss (on the device). ``graphed``: the
    step is to be captured in a CUDA graph (see :func:`forward`)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = forward(model, x, config.T, config.amp, graphed=graphed)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset,
    config: TrainConfig,
    epoch: int,
    graphed: GraphedStep[torch.Tensor] | None = None,
    ranks: Ranks = ONE_PROCESS,
) -> float:
    """Run one epoch and return the mean training loss (over all ranks). ``graphed``: this
    ``model``'s and ``optimizer``'s :func:`train_step`, replayed from CUDA graphs; else the
    steps run eagerly. ``model`` may be DistributedDataParallel."""
    model.train()
    # Cosine decay, computed from the epoch alone so a resumed run needs no scheduler state.
    for group in optimizer.param_groups:
        group["lr"] = config.lr * 0.5 * (1.0 + math.cos(math.pi * epoch / config.epochs))
    step: TrainStep
    if graphed is None:
        step = train_step(model, optimizer, config)
    else:
        graphed.invalidate()  # captured with the last epoch's learning rate
        step = graphed
    order = epoch_order(config, epoch, len(data.y_train), ranks).to(data.y_train.device)
    batches = order.split(config.batch_size)
    if config.T == 1 and config.last_bn_maps_are_1x1 and len(batches) > 1 and len(batches[-1]) == 1:
        # a last batch of one sample (batch sizes of 1 are refused): skipped, since the order
        # changes every epoch, each sample is still seen
        batches = batches[:-1]
    progress = None
    if not config.quiet and ranks.main:
        require(TRAIN, "demo", NEEDS_PROGRESS)
        from tqdm import tqdm

        progress = tqdm(
            batches,
            desc=f"epoch {epoch + 1}/{config.epochs}",
            unit="batch",
            leave=False,
            disable=None,  # only on a terminal
        )
    total_loss, seen = 0.0, 0
    for batch, index in enumerate(batches if progress is None else progress):
        x, y = data.x_train[index], data.y_train[index]
        loss = step(x, y)
        if ranks.distributed:  # every rank sees the same loss, so all stop together on NaN
            loss = loss.clone()
            torch.distributed.all_reduce(loss)
            loss /= ranks.world_size
        value = loss.item()
        if not math.isfinite(value):
            raise SpikefuseError(
                f"the training diverged: the loss is {value} in epoch {epoch + 1}, batch "
                f"{batch + 1} (a smaller --lr may help); checkpoint '{config.checkpoint}' "
                f"is left as it was"
            )
        total_loss, seen = total_loss + value * len(index), seen + len(index)
        if progress is not None:
            progress.set_postfix(loss=f"{value:.3f}")
    return total_loss / seen


def optional_needs(config: TrainConfig) -> dict[str, str]:
    """The optional packages (:mod:`spikefuse.extras`) a run of ``config`` imports, and what
    for. Every rank checks the same ones, so that a missing one stops all of them at once."""
    return {
        **NEEDS_PLOT,
        **(NEEDS_DIGITS if config.data == "digits" else {}),
        **(NEEDS_PROGRESS if not config.quiet else {}),
    }


def run(config: TrainConfig) -> float:
    """Train (or resume) as ``config`` says, print progress, and return the test accuracy.

    The checkpoint is locked for the whole run, and checked to be writable (and, unless
    ``config.resume`` or ``config.overwrite``, not to exist) before training starts. Under
    ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every process runs this: the model is
    wrapped in DistributedDataParallel (gloo on the CPU, NCCL on GPUs, one per local rank),
    and rank 0 alone takes the lock, writes the checkpoint and log, and prints.
    """
    require(TRAIN, "demo", optional_needs(config))
    ranks = ranks_from_env()
    device = resolve_device(config.device)
    if config.graph_mode(device) != "off" and device.type != "cuda":
        raise SpikefuseError(
            f"--cuda-graph {config.cuda_graph} needs a CUDA GPU, and PyTorch sees none "
            "(--no-cuda-graph runs eagerly)"
        )
    if not ranks.distributed:
        backend = describe_backend(config.backend, device)
        return _run_locked(config, device, backend, ranks)
    if config.graph_mode(device) == "step":
        raise SpikefuseError(
            "--cuda-graph step does not run under torchrun (DistributedDataParallel's "
            "all-reduces run between backward and the optimizer); use --cuda-graph model"
        )
    if device.type == "cuda":
        if ranks.local_rank >= torch.cuda.device_count():
            raise SpikefuseError(
                f"LOCAL_RANK={ranks.local_rank}, but PyTorch sees {torch.cuda.device_count()} "
                f"GPU(s): start at most one process per GPU (torchrun --nproc-per-node)"
            )
        device = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(device)
    backend = describe_backend(config.backend, device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _run_locked(config, device, backend, ranks)
    finally:
        # DistributedDataParallel holds reference cycles: collect it, and its reducer, while the
        # process group still exists (a reducer that outlives it can abort the process at exit).
        gc.collect()
        torch.distributed.destroy_process_group()


def _run_locked(config: TrainConfig, device: torch.device, backend: str, ranks: Ranks) -> float:
    checkpoint = Path(config.checkpoint)
    with contextlib.ExitStack() as stack:
        error = None
        if ranks.main:
            try:
                target = checkpoint_target(checkpoint)
                prepare_checkpoint_dir(checkpoint, target, config)
                stack.enter_context(checkpoint_lock(checkpoint, target))
                csv_path, png_path = log_paths(target)
                for path, is_ours in (
                    (target, is_checkpoint_head),
                    (csv_path, is_log_head),
                    (png_path, is_plot_head),
                ):
                    remove_stale_temp_files(path, is_ours)
                check_checkpoint_writable(checkpoint, target, config)
                check_logs_writable(target, config)
            except SpikefuseError as exc:
                error = exc
        agree(ranks, error)
        return _train(config, device, backend, checkpoint, ranks)


def _train(
    config: TrainConfig, device: torch.device, backend: str, checkpoint: Path, ranks: Ranks
) -> float:
    say = functools.partial(print, flush=True) if ranks.main else lambda *args, **kw: None
    error = None
    try:
        model, optimizer, data, log = _set_up(config, device, backend, checkpoint, ranks, say)
    except SpikefuseError as exc:
        error = exc
    agree(ranks, error)
    start_epoch = log.resumed_epoch
    work = {
        "training samples": len(data.y_train),
        "test samples": len(data.y_test),
        "resumed epoch": start_epoch,
        "epochs": config.epochs,
        "batch size": config.batch_size,
    }
    agree_on_work(ranks, work)  # before DistributedDataParallel's first broadcast

    trained = model
    graphs = config.graph_mode(device)
    if graphs == "model":  # before DDP wraps it: DDP's hooks and all-reduces stay eager
        graph_model(model)
    if ranks.distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        trained = nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    graphed = None
    if graphs == "step":  # a batch shape's first step runs eagerly, the next is captured
        graphed = GraphedStep(train_step(trained, optimizer, config, graphed=True), warmup=1)
    with cpu_threads(device, 1):
        accuracy = None
        for epoch in range(start_epoch, config.epochs):
            began = time.perf_counter()
            loss = train_epoch(trained, optimizer, data, config, epoch, graphed, ranks)
            accuracy = evaluate(model, data.x_test, data.y_test, config.T, config.amp)
            seconds = time.perf_counter() - began
            error = None
            if ranks.main:
                try:
                    _keep_epoch(config, model, optimizer, log, (epoch + 1, loss, accuracy, seconds))
                except SpikefuseError as exc:
                    error = exc
            agree(ranks, error)
            say(
                f"epoch {epoch + 1}/{config.epochs}: train loss {loss:.4f}, "
                f"test accuracy {accuracy:.4f} ({seconds:.1f}s)"
            )
        if accuracy is None:  # resumed a run that had already finished
            accuracy = evaluate(model, data.x_test, data.y_test, config.T, config.amp)
    say(f"checkpoint: {checkpoint}")
    say(f"final test accuracy: {accuracy:.4f}")
    return accuracy


def _keep_epoch(
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    log: TrainingLog,
    row: tuple[int, float, float, float],
) -> None:
    """Write an epoch's log row, checkpoint and plot, in the order that keeps them consistent
    at every instant (see :class:`TrainingLog`): the checkpoint is serialised and checked
    first, so that a refused one leaves the log as it was."""
    epoch, _, accuracy, _ = row
    payload = {
        "format": CHECKPOINT_FORMAT,
        "version": CHECKPOINT_VERSION,
        "epoch": epoch,
        "config": config.model_config(),
        "test_accuracy": accuracy,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    data = checkpoint_bytes(Path(config.checkpoint), payload)
    log.add(*row)
    replace_file(Path(config.checkpoint), data, "checkpoint")
    log.plot()


def _set_up(
    config: TrainConfig,
    device: torch.device,
    backend: str,
    checkpoint: Path,
    ranks: Ranks,
    say: Callable[..., None],
) -> tuple[nn.Module, torch.optim.Optimizer, Dataset, TrainingLog]:
    """Load the data, build (and fuse) the model, resume it and the log if asked."""
    torch.manual_seed(config.seed)
    data = load_data(config)
    model, data = build_network(config, data)
    data, model = data.to(device), model.to(device)
    report = None
    if config.fuse:
        # Under torchrun the fused BatchNorms synchronise over the default process group.
        model, report = fuse(model, return_report=True, memory=config.memory)
    # capturable: Adam's step count stays on the GPU, so a graph can replay optimizer.step
    graphs = config.graph_mode(device)
    capturable = graphs == "step"
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr, capturable=capturable)
    say(
        f"device: {device}, backend: {backend}, neuron: {config.neuron}, T={config.T}, "
        f"CUDA graphs: {graphs}, "
        f"train/test samples: {len(data.y_train)}/{len(data.y_test)}"
        + (f", model: {config.model}" if config.model != "digits-cnn" else "")
        + (f", processes: {ranks.world_size}" if ranks.distributed else "")
    )
    if report is not None:
        say(str(report).splitlines()[0])
    start_epoch = 0
    if config.resume:  # every rank reads the checkpoint: all start from the same state
        payload = load_checkpoint(checkpoint, config)
        restore(model, optimizer, payload, checkpoint)
        set_capturable(optimizer, capturable)  # the checkpoint's run may have differed
        start_epoch = payload["epoch"]
        say(f"resumed from '{checkpoint}' after epoch {start_epoch}")
    log = TrainingLog(checkpoint_target(checkpoint), start_epoch)
    if ranks.main:
        log.load()
        log.repair()
    return model, optimizer, data, log
