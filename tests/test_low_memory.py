"""fuse(model, memory="min"): blocks keep only their (1-bit packed) input and recompute the
synapse in backward; everything else equals the default mode."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import gen
from spikefuse import fuse, layer, neuron
from spikefuse.cuda import spike_bits as cuda_bits
from spikefuse.errors import SpikefuseError
from spikefuse.fused import FusedBlock, chunked, recompute, spike_bits
from spikefuse.fused import memory as memory_module
from spikefuse.fused import synapse as synapse_module
from spikefuse.fused.pooling import SpikePool
from spikefuse.fused.recompute import is_spikes, mark_spikes, recipe_of
from spikefuse.fused.spike_bits import PackedSpikes, memory_order, pack_bits, unpack_bits
from test_codegen import assert_compiles_without_spills, needs_nvcc
from test_fused import (
    FP64_TOL,
    assert_same_training_step,
    conv_bn_lif,
    conv_stack,
    lif,
    run,
    saved_bytes,
)


@pytest.mark.parametrize("step", [32, 1 << 24], ids=["in-steps", "at-once"])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_pack_bits_round_trip(n, dtype, step, monkeypatch):
    monkeypatch.setattr(spike_bits, "_PACK_STEP", step)  # several steps and a partial last one
    spikes = (torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5).to(dtype)
    packed = pack_bits(spikes, (0,))
    words = -(-n // 32)
    assert packed.dtype == torch.uint8 and packed.numel() == 5 * words  # + a NaN flag per word
    assert torch.equal(unpack_bits(packed, spikes.shape, dtype, (0,)), spikes)
    bits = packed[: 4 * words, None].bitwise_right_shift(torch.arange(8, dtype=torch.uint8)) & 1
    assert torch.equal(bits.flatten()[:n], spikes.to(torch.uint8))  # bit k of byte i: 8 i + k
    assert not bits.flatten()[n:].any() and not packed[4 * words :].any()  # zero past n; no NaN


def test_pack_bits_layout():
    """Little-endian 32-bit words: the bytes of the first 8 values, then the next 8, ...; then
    a NaN flag byte per word."""
    spikes = torch.zeros(40)
    spikes[[0, 9, 10, 39]] = 1
    assert pack_bits(spikes, (0,)).tolist() == [1, 6, 0, 0, 128, 0, 0, 0, 0, 0]
    spikes[35] = float("nan")
    assert pack_bits(spikes, (0,)).tolist() == [1, 6, 0, 0, 136, 0, 0, 0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_packed_nan_comes_back_as_nan(dtype, monkeypatch):
    """1 bit cannot hold a NaN spike (a neuron whose input was NaN): unpacking then gives NaN
    in the 32 elements of its word, never a valid-looking 1."""
    monkeypatch.setattr(spike_bits, "_PACK_STEP", 32)
    spikes = torch.ones(5, 14, dtype=dtype)
    spikes[3, 2] = float("nan")  # element 44: the second word's
    out = PackedSpikes.of(spikes).unpack().flatten()
    assert out[32:64].isnan().all() and torch.equal(out[:32], spikes.flatten()[:32])
    assert torch.equal(out[64:], spikes.flatten()[64:])
    spikes[3, 2] = 1
    assert torch.equal(PackedSpikes.of(spikes).unpack(), spikes)


@needs_nvcc
def test_the_packing_kernels_compile_with_nvcc(tmp_path):
    """Both kernels of every storage dtype compile for sm_80 and sm_90 as NVRTC compiles them,
    without spilling registers."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    sources = [cuda_bits.kernels_for(dtype).source for dtype in dtypes]
    assert_compiles_without_spills(tmp_path, sources, ("PACK_KERNEL", "UNPACK_KERNEL"))


def test_min_memory_keeps_a_nan_in_its_input_spikes(monkeypatch):
    """A NaN reaching a block's input spikes (no BatchNorm to spread it) makes its weight
    gradient NaN, as in the default mode (the packing must not turn it into a spike)."""
    x = torch.rand(3, 2, 3, 8, 8, dtype=torch.float64) * 2
    x[1, 0, 0, 4, 4] = float("nan")
    grads = []
    for memory in ("default", "min"):
        model = fuse(conv_stack(torch.float64, bn=False), memory=memory)
        model(x).sum().backward()
        grads.append(model[5].synapse.weight.grad)  # the third convolution's (spike input)
    assert grads[0].isnan().any() and grads[1].isnan().any()


def test_pack_bits_of_a_strided_map():
    """A channels-last map is packed in its memory order and unpacked in the same layout."""
    x = (torch.rand(2, 3, 4, 5) > 0.5).float().contiguous(memory_format=torch.channels_last)
    order = memory_order(x)
    assert order == (0, 2, 3, 1)
    y = unpack_bits(pack_bits(x, order), x.shape, x.dtype, order)
    assert torch.equal(y, x) and y.stride() == x.stride()
    z = torch.rand(4, 6)[:, ::2]  # not dense: logical order
    assert memory_order(z) == (0, 1)


def test_min_memory_equals_the_default_mode():
    """Outputs, input and every parameter gradient and the running statistics, float64."""
    x = torch.rand(5, 2, 3, 8, 8, dtype=torch.float64) * 2
    default = fuse(conv_stack(torch.float64))
    low = fuse(conv_stack(torch.float64), memory="min")
    assert all(b.memory == "min" for b in low.modules() if isinstance(b, FusedBlock))
    for _ in range(2):  # twice: the running statistics move
        assert_same_training_step(default, low, x, FP64_TOL)


def test_min_memory_keeps_only_the_packed_input():
    """Conv-BN-LIF, Conv-BN-LIF: the first block keeps nothing new (its input is the model
    input), the second its input spikes at 1 bit each; both keep mean and invstd."""
    t, b, c, h, w = 4, 8, 16, 8, 8
    model = nn.Sequential(*conv_bn_lif(3, c), *conv_bn_lif(c, c))
    x = torch.randn(t, b, 3, h, w)
    spikes = t * b * c * h * w
    vectors = 2 * c * 4  # mean, invstd
    packed = spikes // 8 + spikes // 32  # + a NaN flag byte per 32 spikes
    assert saved_bytes(fuse(model, memory="min"), x) == packed + 2 * vectors
    assert saved_bytes(fuse(model), x) == 2 * (4 * spikes + vectors)  # y of both blocks


def test_default_memory_recomputes_a_stem(monkeypatch):
    """memory="default": a block on an input kept anyway for the weight gradient (here the
    model's input) recomputes y where that costs at most DEFAULT_MAX_MACS_PER_SAVED_BYTE
    multiply-adds per byte saved (3 x 3 on 3 channels: 27 per float64 element, about 3.4 per
    byte; on 32 channels: 36 per byte) and saves at least
    DEFAULT_RECOMPUTE_MIN_BYTES; the same training step as keeping y. Kept then: the second
    block's y and the vectors (its input spikes: the bits the first block's kernel packed,
    behind the layers' own saved-tensor hook)."""
    t, b, c, h, w = 4, 8, 32, 8, 8
    model = nn.Sequential(*conv_bn_lif(3, c), *conv_bn_lif(c, c)).double()
    x = torch.randn(t, b, 3, h, w, dtype=torch.float64)
    spikes = t * b * c * h * w
    vectors = 2 * c * 8  # mean, invstd
    keeping, stem = fuse(copy.deepcopy(model)), fuse(copy.deepcopy(model))
    assert saved_bytes(keeping, x) == 2 * (8 * spikes + vectors)  # each y under the bytes
    kept_step = run(keeping, x)
    monkeypatch.setattr(memory_module, "DEFAULT_RECOMPUTE_MIN_BYTES", 4 * spikes)
    assert saved_bytes(stem, x) == 8 * spikes + 2 * vectors
    blocks = [m for m in stem.modules() if isinstance(m, FusedBlock)]
    assert [block.memory_choice for block in blocks] == ["min", "default"]
    out, grad_x, grads = run(stem, x)
    torch.testing.assert_close(out, kept_step[0], **FP64_TOL)
    torch.testing.assert_close(grad_x, kept_step[1], **FP64_TOL)
    for got, want in zip(grads, kept_step[2], strict=True):
        torch.testing.assert_close(got, want, **FP64_TOL)
    monkeypatch.setattr(memory_module, "DEFAULT_MAX_MACS_PER_SAVED_BYTE", 3)
    assert saved_bytes(stem, x) == 2 * (8 * spikes + vectors)


def test_default_memory_keeps_y_where_nothing_needs_a_gradient(monkeypatch):
    """A frozen stem run with grad on takes the default path (which then saves nothing), and
    planning a call on an input repeated over time by expand copies nothing."""
    monkeypatch.setattr(memory_module, "DEFAULT_RECOMPUTE_MIN_BYTES", 0)
    block = FusedBlock(*conv_bn_lif(3, 8))
    x = torch.rand(4, 2, 3, 8, 8)
    assert block.memory_policy.plan(block, x, None) is memory_module.MIN_MEMORY_PLAN
    block.requires_grad_(False)
    assert block.memory_policy.plan(block, x, None) is memory_module.DEFAULT_PLAN
    block(x)
    assert block.memory_choice == "default"
    images = torch.rand(2, 3, 8, 8).unsqueeze(0).expand(4, -1, -1, -1, -1)
    block.requires_grad_(True)
    for mode in ("default", "auto"):
        block.memory = mode
        with _Dispatched() as ops:
            block.memory_policy.plan(block, images, None)
        assert ops.names == []


class _Dispatched(TorchDispatchMode):
    """Records the tensor ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["stem", "min", "chunked"])
def test_a_parameter_modified_before_backward_raises(mode, monkeypatch):
    """Blocks that recompute y in backward read the synapse's parameters then: an in-place
    edit since forward (an optimizer step before backward) raises, as autograd's check of the
    kept weight does in the default mode, instead of giving wrong gradients."""
    monkeypatch.setattr(memory_module, "DEFAULT_RECOMPUTE_MIN_BYTES", 0)
    monkeypatch.setattr(memory_module, "batch_chunks", lambda b, y: 2 if mode == "chunked" else 1)
    block = FusedBlock(*conv_bn_lif(3, 8), memory="default" if mode == "stem" else "min")
    out = block(torch.rand(4, 2, 3, 8, 8))
    assert block.memory_choice == "min"
    with torch.no_grad():
        block.synapse.weight.mul_(0.5)
    with pytest.raises(SpikefuseError, match="modified in place between its forward and backward"):
        out.sum().backward()


def test_a_block_pickled_with_an_older_policy_gets_a_new_one():
    """A policy unpickled from another version may lack fields (here its cost cache): the block
    makes a new one of its mode, and trains."""
    import pickle

    block = FusedBlock(*conv_bn_lif(3, 8), memory="auto")
    del block.memory_policy._terms
    loaded = pickle.loads(pickle.dumps(block))
    assert loaded.memory == "auto"
    loaded(torch.rand(4, 2, 3, 8, 8)).sum().backward()


def test_default_memory_keeps_y_on_a_fused_blocks_spikes(monkeypatch):
    """However cheap, a block on a fused block's spikes (which the default mode recomputes
    rather than keeps) keeps its y: here 3 x 3 on 3 channels (27 multiply-adds an element, 3.4
    a byte), while the first block's y is under DEFAULT_RECOMPUTE_MIN_BYTES."""
    t, b, h, w = 4, 8, 8, 8
    model = nn.Sequential(*conv_bn_lif(3, 3), *conv_bn_lif(3, 32)).double()
    x = torch.randn(t, b, 3, h, w, dtype=torch.float64)
    monkeypatch.setattr(memory_module, "DEFAULT_RECOMPUTE_MIN_BYTES", 8 * t * b * 8 * h * w)
    y_bytes = 8 * t * b * (3 + 32) * h * w
    assert saved_bytes(fuse(model), x) == y_bytes + 2 * 8 * (3 + 32)


def test_only_tagged_spikes_are_packed():
    """A block's input is packed only when it is a fused block's unmodified spike output."""
    x = torch.rand(2, 3, 4)
    assert not _packs(x)
    spikes = mark_spikes((x > 0.5).float())
    assert _packs(spikes) and _packs(spikes.flatten(1))
    spikes.mul_(1.0)  # modified in place: no longer known to be 0/1
    assert not _packs(spikes)


def _packs(x: torch.Tensor) -> bool:
    return is_spikes(x)


def test_a_kernel_written_packing_is_kept_and_is_the_recipe():
    """A tensor tagged with the packing a kernel wrote of it (mark_packed; here written by the
    torch path): compact keeps that packing, and unpacking it is the tensor's recipe, also for
    a same-memory view; an in-place edit drops both."""
    x = (torch.rand(3, 2, 4, 5, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    packing = PackedSpikes.of(x)
    recompute.mark_packed(x, packing)
    assert recompute.compact(x) is packing
    assert torch.equal(recipe_of(x)(), x) and torch.equal(
        recipe_of(x.flatten(0, 1))(), x.flatten(0, 1)
    )
    x.mul_(1.0)
    assert recompute.packing_of(x) is None and recipe_of(x) is None


def test_memory_mode_is_validated():
    with pytest.raises(SpikefuseError, match="memory must be one of"):
        fuse(conv_stack(torch.float32), memory="tiny")
    with pytest.raises(SpikefuseError, match="memory must be one of"):
        FusedBlock(nn.Linear(2, 3), None, lif(), memory="low")


@pytest.fixture
def linear_min_mode(monkeypatch):
    """A memory mode registered for one test: Linear blocks recompute, the others keep y."""
    registry = dict(memory_module._POLICIES)
    monkeypatch.setattr(memory_module, "_POLICIES", registry)

    @memory_module.register_memory
    class LinearMin(memory_module.MemoryPolicy):
        name = "linear-min"

        def plan(self, block, x, residual):
            linear = block.spec.kind is nn.Linear
            return memory_module.MIN_MEMORY_PLAN if linear else memory_module.DEFAULT_PLAN

    return LinearMin


def test_a_memory_mode_is_one_registered_class(linear_min_mode):
    """A policy class registered with register_memory is a mode FusedBlock and fuse take, the
    modes list names it, and its plans run: here the same training step as the default mode,
    with the Linear block keeping only its input."""
    assert memory_module.memory_modes()[-1] == "linear-min"
    x = torch.rand(5, 2, 3, 8, 8, dtype=torch.float64) * 2
    default = fuse(conv_stack(torch.float64))
    mixed = fuse(conv_stack(torch.float64), memory="linear-min")
    blocks = [b for b in mixed.modules() if isinstance(b, FusedBlock)]
    assert all(isinstance(b.memory_policy, linear_min_mode) for b in blocks)
    for _ in range(2):  # twice: the running statistics move
        assert_same_training_step(default, mixed, x, FP64_TOL)
    linear = blocks[-1]
    assert linear.spec.kind is nn.Linear and linear.memory_choice == "linear-min"


def test_memory_policies_plan_the_paths():
    """default keeps y; min recomputes it (in chunks where y is large); no policy is asked
    without autograd."""
    block = FusedBlock(nn.Linear(4, 3), nn.BatchNorm1d(3), lif(), memory="min")
    x = torch.rand(2, 5, 4)
    assert block.memory_policy.plan(block, x, None) is memory_module.MIN_MEMORY_PLAN
    block.memory = "default"
    assert block.memory_policy.plan(block, x, None) is memory_module.DEFAULT_PLAN
    with torch.no_grad():  # the default path, whatever the mode
        block.memory = "auto"
        block(x)
        assert block.memory_choice == "auto"


def test_min_memory_recomputes_under_the_forwards_autocast():
    """bf16 autocast: backward recomputes the synapse under the same autocast as forward."""
    x = torch.rand(3, 2, 3, 8, 8) * 2
    default = fuse(conv_stack(torch.float32))
    low = fuse(conv_stack(torch.float32), memory="min")
    grads = []
    for model in (default, low):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for g_default, g_low in zip(*grads, strict=True):
        torch.testing.assert_close(g_low, g_default)


def test_min_memory_recomputes_one_step_of_an_input_repeated_over_time(monkeypatch):
    """images.expand(T, ...): backward recomputes the first convolution on the B images, as
    forward ran it (not on T * B samples), and neither copies its output to T steps."""
    batches, copies = [], []
    monkeypatch.setattr(synapse_module, "repeat_over_time", lambda *a: copies.append(a))
    conv2d = torch.nn.functional.conv2d

    def recording(x, weight, *args, **kwargs):
        if weight.shape[1] == 3:  # the first convolution
            batches.append(x.shape[0])
        return conv2d(x, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv2d", recording)
    low = fuse(conv_stack(torch.float64), memory="min")
    images = torch.rand(2, 3, 8, 8, dtype=torch.float64)
    low(images.unsqueeze(0).expand(4, -1, -1, -1, -1)).sum().backward()
    assert batches == [2, 2] and not copies  # forward, and backward's recompute


def _synapse_pair(synapse: nn.Module) -> nn.Sequential:
    """A Conv/Linear -> BN -> LIF block after a first Conv-BN-LIF block (so its input is spikes,
    packed in memory mode), unfused, float64."""
    second = {nn.Conv1d: layer.BatchNorm1d, nn.Conv2d: layer.BatchNorm2d, nn.Linear: None}
    channels = synapse.out_features if isinstance(synapse, nn.Linear) else synapse.out_channels
    bn = layer.BatchNorm1d if isinstance(synapse, nn.Linear) else second[type(synapse)]
    torch.manual_seed(0)
    return nn.Sequential(
        layer.SeqToANNContainer(synapse),
        bn(channels, step_mode="m"),
        lif(),
    ).double()


SYNAPSES = {  # explicit backward: numeric zero padding; autograd: string padding, reflect
    "conv2d-stride-dilation-groups-bias": lambda: nn.Conv2d(4, 6, 3, 2, 2, 2, groups=2),
    "conv1d-bias": lambda: nn.Conv1d(4, 6, 3, padding=2),
    "linear-bias": lambda: nn.Linear(4, 6),
    "linear": lambda: nn.Linear(4, 6, bias=False),
    "conv2d-same-padding (autograd)": lambda: nn.Conv2d(4, 6, 3, padding="same", bias=False),
    "conv2d-reflect (autograd)": lambda: nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"),
}
SHAPES = {nn.Conv2d: (4, 7, 7), nn.Conv1d: (4, 9), nn.Linear: (4,)}


@pytest.mark.parametrize("spikes", [True, False], ids=["spike-input", "real-input"])
@pytest.mark.parametrize("make", SYNAPSES.values(), ids=SYNAPSES.keys())
def test_min_memory_equals_the_default_mode_for_every_synapse(make, spikes):
    """Every synapse configuration, bias or not, input spikes (packed) or real values, with and
    without an input gradient: memory="min" equals the default mode in float64."""
    synapse = make()
    model = _synapse_pair(synapse)
    default, low = fuse(copy.deepcopy(model)), fuse(copy.deepcopy(model), memory="min")
    assert sum(isinstance(m, FusedBlock) for m in low.modules()) == 1
    x = torch.rand(5, 2, *SHAPES[type(synapse)], dtype=torch.float64, generator=gen(5)) * 2
    if spikes:
        x = mark_spikes((x > 1).double())
    for _ in range(2):
        assert_same_training_step(default, low, x, FP64_TOL)
    frozen = x.detach()  # no input gradient wanted: the input-gradient pass is skipped
    out_d, out_l = default(frozen), low(frozen)
    (out_d.sum() + out_l.sum()).backward()
    for p_d, p_l in zip(default.parameters(), low.parameters(), strict=True):
        torch.testing.assert_close(p_l.grad, p_d.grad, **FP64_TOL)


@pytest.fixture
def packed(monkeypatch) -> list[torch.Size]:
    """The shapes of the tensors packed (PackedSpikes.of) while the test runs, in order."""
    shapes: list[torch.Size] = []
    pack = PackedSpikes.of
    monkeypatch.setattr(PackedSpikes, "of", lambda t: shapes.append(t.shape) or pack(t))
    return shapes


def _choices(model: nn.Module) -> list[str]:
    return [b.memory_choice for b in model.modules() if isinstance(b, FusedBlock)]


def test_auto_memory_recomputes_where_it_pays(monkeypatch):
    """memory="auto": a block recomputes where that costs at most AUTO_MAX_MACS_PER_SAVED_ELEMENT
    multiply-adds per element saved. conv_stack, T=3, float64 (a packed spike: 1/64 element):
    the first conv pools its spikes (27 per output element; saved: y less the pooled map the
    next layer then keeps, 3/4 of y: 36 per element saved); the next two convs (72 per output
    element) save y less their packed spikes, and less their packed input where the block before
    kept y (74): limit 200 recomputes all three, limit 70 only the first; the Linear (128 per
    output element, 130 or 174 per element saved) follows the block before it."""
    monkeypatch.setattr(memory_module, "AUTO_MAX_MACS_PER_SAVED_ELEMENT", 200)
    auto = fuse(conv_stack(torch.float64), memory="auto")
    x = torch.rand(3, 2, 3, 8, 8, dtype=torch.float64)
    assert _choices(auto) == ["auto"] * 4  # chosen on the first training call
    auto(x).sum().backward()
    assert _choices(auto) == ["min"] * 4
    monkeypatch.setattr(memory_module, "AUTO_MAX_MACS_PER_SAVED_ELEMENT", 70)
    auto(x).sum().backward()
    assert _choices(auto) == ["min", "default", "default", "default"]
    with torch.no_grad():  # no training call: no choice
        monkeypatch.setattr(memory_module, "AUTO_MAX_MACS_PER_SAVED_ELEMENT", 1)
        auto(x)
    assert _choices(auto) == ["min", "default", "default", "default"]


def test_auto_memory_keeps_outputs_larger_inputs_would_replace():
    """A Linear whose input spikes (recomputed in the default mode) take more memory packed
    than its output keeps the output, however cheap the Linear."""
    linear = nn.Linear(64 * 16, 2, bias=False), nn.BatchNorm1d(2), lif()
    auto = nn.Sequential(
        FusedBlock(*_parts(3, 64)), layer.Flatten(step_mode="m"), FusedBlock(*linear, memory="auto")
    )
    auto(torch.rand(2, 3, 3, 4, 4)).sum().backward()
    assert _choices(auto) == ["default", "default"]


def test_auto_memory_equals_the_default_mode(monkeypatch):
    """Blocks of both modes in one model (and an input repeated over time): outputs, input and
    parameter gradients and running statistics equal the default mode's, float64."""
    monkeypatch.setattr(memory_module, "AUTO_MAX_MACS_PER_SAVED_ELEMENT", 70)
    default = fuse(conv_stack(torch.float64))
    auto = fuse(conv_stack(torch.float64), memory="auto")
    x = torch.rand(5, 2, 3, 8, 8, dtype=torch.float64) * 2
    for _ in range(2):
        assert_same_training_step(default, auto, x, FP64_TOL)
    assert _choices(auto) == ["min", "default", "default", "default"]
    images = torch.rand(2, 3, 8, 8, dtype=torch.float64).unsqueeze(0).expand(4, -1, -1, -1, -1)
    outputs = [model(images) for model in (default, auto)]
    torch.testing.assert_close(outputs[1], outputs[0], **FP64_TOL)
    for out in outputs:
        out.sum().backward()
    for p_d, p_a in zip(default.parameters(), auto.parameters(), strict=True):
        torch.testing.assert_close(p_a.grad, p_d.grad, **FP64_TOL)


def test_spikes_of_a_min_block_are_saved_packed_by_the_next_layers(packed):
    """A min block's output spikes have no recipe (it keeps no synapse output): the default
    block after it saves them at 1 bit per element, not as float32; a max pooling keeps none
    of them, only a byte per output value (spike_max_pool2d)."""
    t, b, c, h, w = 4, 8, 16, 8, 8
    spikes = t * b * c * h * w
    vectors = 2 * c * 4  # mean, invstd
    first = FusedBlock(*_parts(3, c), memory="min")
    x = torch.randn(t, b, 3, h, w)
    # what the saving hook holds (the packing) is not counted: the float32 s1 is not there
    assert (
        saved_bytes(nn.Sequential(first, FusedBlock(*_parts(c, c))), x) == 2 * vectors + 4 * spikes
    )
    assert packed == [(t * b, c, h, w)]
    pooled = nn.Sequential(first, SpikePool(nn.MaxPool2d(2)))
    assert saved_bytes(pooled, x) == vectors + spikes // 4
    assert packed[1:] == [] and pooled(x).shape == (t, b, c, h // 2, w // 2)


def _parts(c_in: int, c_out: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    return nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), lif()


def test_packed_saved_spikes_keep_their_values():
    """The default block after a min block trains as with float32 spikes (float64 here)."""
    torch.manual_seed(0)
    parts = [_parts(3, 8), _parts(8, 8)]
    ref = nn.Sequential(*(FusedBlock(*copy.deepcopy(p)) for p in parts)).double()
    mixed = nn.Sequential(
        FusedBlock(*copy.deepcopy(parts[0]), memory="min"), FusedBlock(*copy.deepcopy(parts[1]))
    ).double()
    x = torch.rand(4, 2, 3, 6, 6, dtype=torch.float64) * 2
    assert_same_training_step(ref, mixed, x, FP64_TOL)


@pytest.mark.parametrize(
    "synapse",
    [
        nn.Conv2d(6, 4, 3, stride=2, padding=2, dilation=2, groups=2),
        nn.Conv2d(6, 4, (3, 1), stride=(1, 2), padding=(0, 1)),
        nn.Conv2d(6, 4, 3, padding="same"),
        nn.Conv2d(6, 4, 5, padding="valid"),
        nn.Conv1d(6, 4, 4, stride=3, padding=1, dilation=2),
        nn.Linear(6, 4),
    ],
    ids=["2d-strided-dilated-groups", "2d-asymmetric", "2d-same", "2d-valid", "1d", "linear"],
)
def test_auto_memory_counts_the_synapse_output_and_its_cost(synapse):
    """The elements of one step's output and the multiply-adds per output element, as the
    synapse computes them."""
    block = FusedBlock(synapse, None, lif(), memory="auto")
    shapes = {nn.Conv1d: (2, 6, 11), nn.Conv2d: (2, 6, 9, 10), nn.Linear: (2, 6)}
    step = torch.rand(shapes[type(synapse)])
    per_step, fan_in = block.synapse_op().geometry(step.shape)
    assert per_step == synapse(step).numel()
    weight = synapse.weight
    assert fan_in == weight[0].numel()  # in_channels / groups x kernel, or in_features


def test_auto_memory_counts_the_map_a_pooling_block_leaves_to_the_next_layer(monkeypatch):
    """A block that pools its spikes saves y less the pooled map (which, with no recipe left,
    the next layer keeps whole): 3/4 of y for 2 x 2 windows."""
    x = torch.rand(2, 2, 3, 8, 8, dtype=torch.float64)
    for limit, choice in ((27 / 0.75 + 0.01, "min"), (27 / 0.75 - 0.01, "default")):
        monkeypatch.setattr(memory_module, "AUTO_MAX_MACS_PER_SAVED_ELEMENT", limit)
        block = FusedBlock(*_parts(3, 8), memory="auto", pool=nn.AvgPool2d(2)).double()
        block(x).sum().backward()
        assert block.memory_choice == choice


def test_max_pooling_of_spikes_gives_spikes():
    """SpikePool(MaxPool2d) tags the maximum of spikes as spikes (the next min block packs it);
    average pooling does not (its windows' means are not 0 or 1)."""
    spikes = mark_spikes((torch.rand(2, 3, 4, 6, 6) > 0.5).float())
    assert is_spikes(SpikePool(nn.MaxPool2d(2))(spikes))
    assert not is_spikes(SpikePool(nn.AvgPool2d(2))(spikes))


def test_an_unfused_conv_saves_a_min_blocks_spikes_packed(packed):
    """fuse() hooks the Conv/Linear layers it leaves unfused (a ResNet's downsample): after a
    min block they save its spikes at 1 bit per element, and train as with float32 spikes."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *conv_bn_lif(3, 4), layer.Conv2d(4, 2, 3, padding=1, step_mode="m")
    ).double()
    x = torch.rand(3, 2, 3, 6, 6, dtype=torch.float64) * 2
    low = fuse(copy.deepcopy(model), memory="min")
    assert_same_training_step(fuse(model), low, x, FP64_TOL)
    assert packed == [(6, 4, 6, 6)]  # the unfused conv's merged input [T*B, C, H, W]


def plif_node() -> neuron.ParametricLIFNode:
    return neuron.ParametricLIFNode(init_tau=3.0, step_mode="m", backend="torch")


@pytest.mark.parametrize("node", ["lif", "plif"])
@pytest.mark.parametrize("chunks", [2, 4])
def test_min_memory_in_batch_chunks_equals_the_default_mode(chunks, node, monkeypatch):
    """Blocks whose synapse output is large run in equal batch chunks (here every block with
    BatchNorm, in ``chunks``): outputs, input and parameter gradients and the running
    statistics equal the default mode's in float64, in training and in eval."""
    parts = []
    real_parts = memory_module.batch_parts
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: chunks)
    monkeypatch.setattr(
        memory_module,
        "batch_parts",
        lambda *a: parts.append(a) or real_parts(*a),  # type: ignore[func-returns-value]
    )
    make = lif if node == "lif" else plif_node
    x = torch.rand(5, 4, 3, 8, 8, dtype=torch.float64, generator=gen(3)) * 2
    default = fuse(conv_stack(torch.float64, node=make))
    low = fuse(conv_stack(torch.float64, node=make), memory="min")
    for _ in range(2):  # twice: the running statistics move
        assert_same_training_step(default, low, x, FP64_TOL)
    assert parts == [(4, chunks)] * 8  # four blocks, two steps
    default.eval()
    low.eval()
    assert_same_training_step(default, low, x, FP64_TOL)  # running statistics


@pytest.mark.parametrize("spikes", [True, False], ids=["spike-input", "real-input"])
@pytest.mark.parametrize(
    "make", [m for k, m in SYNAPSES.items() if "autograd" not in k], ids=lambda m: ""
)
def test_min_memory_in_batch_chunks_for_every_synapse(make, spikes, monkeypatch):
    """Every synapse with an explicit backward, bias or not, spikes (packed, unpacked by
    chunks) or real input, with and without an input gradient: chunked equals the default
    mode in float64."""
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: 3)
    synapse = make()
    model = _synapse_pair(synapse)
    if spikes:  # tagged inside the model: the test's copies of x drop the tag
        model = nn.Sequential(TagSpikes(), *model)
    default, low = fuse(copy.deepcopy(model)), fuse(copy.deepcopy(model), memory="min")
    x = torch.rand(5, 6, *SHAPES[type(synapse)], dtype=torch.float64, generator=gen(5)) * 2
    if spikes:
        x = (x > 1).double()
    for _ in range(2):
        assert_same_training_step(default, low, x, FP64_TOL)
    frozen = x.detach()
    (default(frozen).sum() + low(frozen).sum()).backward()
    for p_d, p_l in zip(default.parameters(), low.parameters(), strict=True):
        torch.testing.assert_close(p_l.grad, p_d.grad, **FP64_TOL)


def test_a_chunked_block_keeps_its_input_packed_and_unpacks_it_by_chunks(monkeypatch):
    """Spike input in 2 chunks: each chunk's input is kept packed (as much as the whole
    input's packing, rows padded to 16 bytes), and backward unpacks one chunk at a time, never
    the whole input."""
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: 2)
    t, b, c, h, w = 4, 8, 16, 8, 8
    model = nn.Sequential(*conv_bn_lif(3, c), *conv_bn_lif(c, c))
    x = torch.randn(t, b, 3, h, w)
    spikes = t * b * c * h * w
    vectors = 2 * c * 4  # mean, invstd
    # the first block keeps the model input itself (it is the caller's anyway)
    assert saved_bytes(fuse(model, memory="min"), x) == spikes // 8 + spikes // 32 + 2 * vectors
    unpacked = []
    real_unpack = PackedSpikes.unpack
    monkeypatch.setattr(
        PackedSpikes, "unpack", lambda p: unpacked.append(p.shape) or real_unpack(p)
    )
    fuse(model, memory="min")(x.requires_grad_()).sum().backward()
    assert unpacked and set(unpacked) == {torch.Size((t * b // 2, c, h, w))}


@pytest.mark.parametrize(
    ("batch", "mib", "chunks"),
    [(64, 255, 1), (64, 256, 2), (64, 320, 4), (64, 1024, 8), (6, 400, 6), (7, 300, 7)],
)
def test_batch_chunks_are_the_fewest_equal_ones_within_the_bound(batch, mib, chunks):
    assert (chunked.CHUNKED_FROM, chunked.CHUNK_BYTES) == (256 << 20, 128 << 20)
    assert chunked.batch_chunks(batch, mib << 20) == chunks


class TagSpikes(nn.Module):
    """Tags its (0/1) input as a fused block's spikes, as if one made it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mark_spikes(x * 1)


def test_a_packing_is_cut_into_its_batch_chunks_where_they_fill_words():
    t, b, n = 3, 4, 16
    values = (torch.rand(t, b, n, generator=gen(2)) > 0.5).float()
    values[2, 1, 3] = float("nan")
    whole = PackedSpikes.of(values)
    restored = whole.unpack()  # the NaN poisons its word: the 32 values of 2 samples
    for index in (0, 1):
        part = spike_bits.packing_part(whole, index, 2)
        assert part is not None and part.shape == (t, 2, n)
        chunk = restored[:, 2 * index : 2 * index + 2]
        assert torch.equal(part.unpack().nan_to_num(7), chunk.nan_to_num(7))
    assert restored.isnan().sum() == 32
    assert spike_bits.packing_part(whole, 0, 4) is None  # 16 bits a step: not whole words
    assert spike_bits.packing_part(PackedSpikes.of(values.transpose(0, 1)), 0, 2) is None


def test_packings_of_batch_chunks_join_into_the_whole_ones():
    """Per step, the chunks' words in batch order, then their flags: the packing of the whole."""
    t, b, n = 3, 4, 16
    values = (torch.rand(t, b, n, generator=gen(1)) > 0.5).float()
    values[1, 2, 5] = float("nan")
    order = (0, 1, 2)
    parts = [pack_bits(values[:, i : i + 2].contiguous(), order) for i in (0, 2)]
    assert torch.equal(spike_bits.joined_batch_chunks(parts, t), pack_bits(values, order))


def test_auto_memory_never_chunks(monkeypatch):
    """memory="auto" recomputes unchunked: its rule prices one synapse forward."""
    monkeypatch.setattr(memory_module, "batch_chunks", lambda batch, y_bytes: 2)
    taken = []
    monkeypatch.setattr(memory_module, "chunked_path", lambda *a: taken.append(a))
    model = fuse(nn.Sequential(*conv_bn_lif(3, 8), *conv_bn_lif(8, 8)), memory="auto")
    model(torch.rand(2, 4, 3, 8, 8).requires_grad_()).sum().backward()
    assert "min" in [b.memory_choice for b in model.modules() if isinstance(b, FusedBlock)]
    assert not taken
