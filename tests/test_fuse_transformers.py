"""fuse() on spikefuse.model's spiking transformers (tiny configurations): every chain fuses,
the stems' chains that max-pool the neuron's input included, and fused equals unfused
(float64: the head's input equal bit for bit, gradients within 1e-9)."""

from __future__ import annotations

import copy

import pytest
import torch

from spikefuse.fused import FusedBlock, fuse
from spikefuse.model import qkformer, spike_driven_transformer, spikformer
from test_fuse_tokens import FP64_TOL, lif, randomized, seq_conv1d_bn, step
from test_transformers import TINY_QKFORMER, TINY_SDT, TINY_SPIKFORMER

# (model, configuration, fused chains, the report's chains): all fused. No chain: SDT's relative
# position encoding and residual branches (Conv -> BN -> addition) and the heads (a Linear: the
# models' forwards are traced, their image-or-sequence branch being one opaque call).
CASES = [
    (spikformer.Spikformer, TINY_SPIKFORMER, 9, 9),
    (spike_driven_transformer.SpikeDrivenTransformer, TINY_SDT, 7, 7),
    (qkformer.QKFormer, TINY_QKFORMER, 22, 22),
]


@pytest.mark.parametrize(("cls", "config", "fused_count", "chains"), CASES)
def test_tiny_transformers_fuse_their_attention_and_compute_the_same(
    cls, config, fused_count, chains
) -> None:
    torch.manual_seed(0)
    ref = randomized(cls(**config))
    fused, report = fuse(ref, return_report=True)
    assert len(report.fused) == fused_count, str(report)
    assert report.chains == chains, str(report)
    attention = [c for c in report.fused if ".attn." in c.block]
    assert attention, str(report)  # the attention layers' Q/K/V and projection chains
    seen: dict[str, list[torch.Tensor]] = {"ref": [], "fused": []}
    for key, model in (("ref", ref), ("fused", fused)):
        model.head.register_forward_pre_hook(lambda _, args, k=key: seen[k].append(args[0]))
    images = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    out_r, grads_r = step(ref, images)
    out_f, grads_f = step(fused, images)
    assert torch.equal(seen["fused"][0], seen["ref"][0])  # from spikes equal bit for bit
    assert 0 < seen["ref"][0].abs().sum()
    torch.testing.assert_close(out_f, out_r, **FP64_TOL)
    assert grads_f.keys() == grads_r.keys()
    for key, grad in grads_r.items():
        torch.testing.assert_close(grads_f[key], grad, **FP64_TOL, msg=lambda m, k=key: f"{k}: {m}")


def test_chains_in_a_module_list_fuse() -> None:
    """torch.fx counts nn.ModuleList and nn.ModuleDict as leaves; fuse searches their children."""

    class Chain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv_bn, self.lif = seq_conv1d_bn(4, 4), lif()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lif(self.conv_bn(x))

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Chain(), Chain()])
            self.named = torch.nn.ModuleDict({"last": Chain()})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dim() != 4:  # not traceable: fuse searches the module tree
                raise ValueError("expected [T, B, C, N]")
            for block in self.blocks:
                x = block(x)
            return self.named["last"](x)

    fused, report = fuse(randomized(Stack()), return_report=True)
    assert report.fused_fraction == 1.0 and len(report.fused) == 3, str(report)
    assert isinstance(fused.blocks[1].conv_bn, FusedBlock)
    assert isinstance(fused.named["last"].conv_bn, FusedBlock)


@pytest.mark.slow
@pytest.mark.parametrize(("cls", "config"), [case[:2] for case in CASES], ids=lambda v: str(v)[:30])
def test_fused_transformers_compile_whole_and_compute_the_same(cls, config) -> None:
    """torch.compile(fullgraph=True) traces a fused transformer without a graph break: the
    attention products, the layout-keeping neurons and the mean over tokens included; its
    output equals eager bit for bit (float64) and its gradients agree within 1e-9."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    fused = fuse(randomized(cls(**config)))
    compiled_model = copy.deepcopy(fused)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    images = torch.rand(3, 3, 8, 8, dtype=torch.float64)
    outputs = [model(images) for model in (fused, compiled)]
    assert torch.equal(outputs[0], outputs[1])
    for out in outputs:
        out.sum().backward()
    for (name, eager), graphed in zip(
        fused.named_parameters(), compiled_model.parameters(), strict=True
    ):
        if eager.grad is not None:
            torch.testing.assert_close(graphed.grad, eager.grad, rtol=1e-9, atol=1e-12, msg=name)
