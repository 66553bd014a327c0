"""A process with no samples contributes nothing to the synchronised BatchNorm.

Two gloo processes: rank 0 has a batch, rank 1 an empty one. Rank 0 must compute exactly what
one process computes alone on its batch (outputs, running statistics, gradients), and rank 1
must see the same (finite) statistics and zero gradients, not NaN.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from spikefuse.fused import FusedLinearBNNeuron, paper_lif

WORLD = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _block() -> FusedLinearBNNeuron:
    torch.manual_seed(0)
    return FusedLinearBNNeuron(5, 4, node=paper_lif(backend="torch")).double()


def _step(block: FusedLinearBNNeuron, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x.clone().requires_grad_()
    out = block(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), [x.grad, *(p.grad for p in block.parameters())]


def _worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    x = torch.randn(3, 6, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    alone = _block()
    out_alone, grads_alone = _step(alone, x)  # before the process group exists: one process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        block = _block()
        mine = x if rank == 0 else x[:, :0]  # rank 1: batch 0
        out, grads = _step(block, mine)
        assert torch.equal(block.bn.running_mean, alone.bn.running_mean), rank
        assert torch.allclose(block.bn.running_var, alone.bn.running_var, rtol=1e-12), rank
        if rank == 0:
            assert torch.equal(out, out_alone)
            for g, g_alone in zip(grads, grads_alone, strict=True):
                torch.testing.assert_close(g, g_alone, rtol=1e-12, atol=1e-12)
        else:
            assert out.shape == (3, 0, 4)
            for g in grads[1:]:
                assert torch.equal(g, torch.zeros_like(g))
    finally:
        dist.destroy_process_group()


def test_rank_with_no_samples_contributes_nothing(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)


def _join_worker(rank: int, port: int) -> None:
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel

    from spikefuse.errors import SpikefuseError

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        block = _block()
        x = torch.randn(3, 4, 5, dtype=torch.float64)
        counter = int(block.bn.num_batches_tracked)
        refused = DistributedDataParallel(block)
        with pytest.raises(SpikefuseError, match="throw_on_early_termination=True"):
            with Join([refused]):
                refused(x)
        assert int(block.bn.num_batches_tracked) == counter  # refused before any state change
        dist.barrier()  # DDP's join hook had started an async all-reduce: let it complete
        # A DDP whose forward raised is not reused; a fresh one trains under an allowed Join.
        ddp = DistributedDataParallel(_block())
        with Join([ddp], throw_on_early_termination=True):  # torch stops all ranks together
            ddp(x).sum().backward()
        ddp(x).sum().backward()  # outside Join: as before
        # Release the DDP reducers before the process group: one left alive at interpreter exit
        # (the refused one, held by the exception's traceback) can abort the process.
        del refused, ddp
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_join_without_early_termination_is_refused(monkeypatch):
    """DDP with Join and uneven batch counts aborted inside the fused BN all-reduce;
    now a Join context that would let ranks run out silently is refused with what to do."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    mp.spawn(_join_worker, args=(free_port(),), nprocs=WORLD, join=True)
