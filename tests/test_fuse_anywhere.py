"""fuse() on any model: chains found by torch.fx in custom forwards, the module-tree fallback,
the report, argument checks and state_dicts that load between fused and unfused models."""

from __future__ import annotations

import copy
import gc
import logging
import pickle
import threading
import weakref

import pytest
import torch
from torch import nn

from spikefuse import functional, layer, models, neuron
from spikefuse.errors import SpikefuseError
from spikefuse.fused import FusedBlock, FuseReport, SpikePool, fuse

T, B, C = 2, 3, 4
FP64_TOL = dict(rtol=1e-9, atol=1e-11)


def lif(**kw) -> neuron.LIFNode:
    return neuron.LIFNode(tau=2.0, step_mode="m", backend="torch", **kw)


def conv(cin: int = C, cout: int = C, step_mode: str = "m") -> nn.Module:
    return layer.Conv2d(cin, cout, 3, padding=1, bias=False, step_mode=step_mode)


def bn(c: int = C) -> nn.Module:
    return layer.BatchNorm2d(c, step_mode="m")


class Block(nn.Module):
    """A SpikingJelly-style basic block: attributes called in a custom forward, a residual
    addition and a Conv -> BN -> neuron downsample branch."""

    def __init__(self, downsample: bool = False) -> None:
        super().__init__()
        self.conv1, self.bn1, self.sn1 = conv(), bn(), lif()
        self.conv2, self.bn2 = conv(), bn()
        self.downsample = nn.Sequential(layer.Conv2d(C, C, 1, step_mode="m"), bn())
        self.downsample_sn = neuron.ParametricLIFNode(step_mode="m", backend="torch")
        self.use_downsample = downsample
        self.sn2 = lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.sn1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))  # BN -> residual addition: not a chain
        if self.use_downsample:
            x = self.downsample_sn(self.downsample(x))
        return self.sn2(out + x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv(3, C), bn(), lif(), layer.MaxPool2d(2, step_mode="m"))
        self.blocks = nn.ModuleList([Block(), Block(downsample=True)])
        self.head = layer.Linear(C, 5, step_mode="m")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((3, 4)))


def randomized(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=gen) * 0.6 - 0.2)
    return model.double()


def training_step(model: nn.Module, x: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    functional.reset_net(model)
    grads = {k: v.grad for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}
    return out.detach(), x.grad, grads


def assert_equivalent(ref: nn.Module, fused: nn.Module, x: torch.Tensor) -> None:
    """Output, input and parameter gradients (by the unfused state_dict keys) and running
    statistics, in training and in eval mode."""
    for training in (True, False):
        ref.train(training)
        fused.train(training)
        out_r, gx_r, gp_r = training_step(ref, x)
        out_f, gx_f, gp_f = training_step(fused, x)
        torch.testing.assert_close(out_f, out_r, **FP64_TOL)
        torch.testing.assert_close(gx_f, gx_r, **FP64_TOL)
        assert gp_f.keys() == gp_r.keys()
        for key in gp_r:
            torch.testing.assert_close(gp_f[key], gp_r[key], **FP64_TOL, msg=key)
        ref.zero_grad()
        fused.zero_grad()
    for key, value in ref.state_dict().items():  # running statistics
        torch.testing.assert_close(fused.state_dict()[key], value, **FP64_TOL, msg=key)


def test_custom_forward_blocks_are_fused_in_place():
    torch.manual_seed(0)
    model = randomized(Net())
    fused, report = fuse(model, return_report=True)
    assert isinstance(report, FuseReport) and report.traced == ["<model>"]
    assert [c.modules for c in report.fused] == [
        ("stem.0", "stem.1", "stem.2"),
        ("blocks.0.conv1", "blocks.0.bn1", "blocks.0.sn1"),
        ("blocks.1.conv1", "blocks.1.bn1", "blocks.1.sn1"),
        ("blocks.1.downsample.0", "blocks.1.downsample.1", "blocks.1.downsample_sn"),
        # BN -> residual addition -> neuron: fused by rewriting the block's forward
        ("blocks.0.conv2", "blocks.0.bn2", "blocks.0.sn2"),
        ("blocks.1.conv2", "blocks.1.bn2", "blocks.1.sn2"),
    ]
    assert [c.residual for c in report.fused] == [False] * 4 + [True] * 2
    assert report.rewritten == ["blocks.0", "blocks.1"]
    assert report.fused_fraction == 1.0 and report.chains == 6
    assert "blocks.0.conv2 -> blocks.0.bn2 -> (+ shortcut) -> blocks.0.sn2" in str(report)
    reasons = {s.modules[0]: s.reason for s in report.skipped}
    assert reasons["head"] == "the output of 'head' goes to the forward's return value"
    assert report.pools == ["stem.3"]
    # The user's classes stay; the BN and neuron attributes are Identity.
    assert type(fused) is Net and type(fused.blocks[1]) is Block
    block = fused.blocks[1]
    assert isinstance(block.conv1, FusedBlock) and block.conv1.synapse is not model.blocks[1].conv1
    assert isinstance(block.bn1, nn.Identity) and isinstance(block.sn1, nn.Identity)
    assert isinstance(block.conv2, FusedBlock) and block.conv2.residual
    assert isinstance(block.bn2, nn.Identity) and isinstance(block.sn2, nn.Identity)
    assert isinstance(block.downsample[0], FusedBlock) and isinstance(
        block.downsample_sn, nn.Identity
    )
    assert isinstance(fused.stem[3], SpikePool)
    assert isinstance(model.blocks[1].bn1, layer.BatchNorm2d)  # the original is untouched
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)


def test_state_dicts_load_both_ways_with_strict_keys():
    torch.manual_seed(0)
    model = randomized(Net())
    fused = fuse(model)
    keys = list(model.state_dict())
    assert list(fused.state_dict()) == keys  # same keys, same order
    assert "blocks.1.downsample_sn.w" in keys and "blocks.0.bn1.running_var" in keys
    # Unfused -> fused, strict: every value arrives (strict=False used to load nothing).
    torch.manual_seed(1)
    other = randomized(Net())
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
        for b in other.buffers():
            b.add_(2)
    result = fused.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in other.state_dict().items():
        assert torch.equal(fused.state_dict()[key], value), key
    assert torch.equal(fused.blocks[0].conv1.bn.running_mean, other.blocks[0].bn1.running_mean)
    # Fused -> unfused, strict.
    model.load_state_dict(fused.state_dict(), strict=True)
    for key, value in other.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # The fused naming (named_parameters) still loads.
    named = {k: v.detach() for k, v in fused.named_parameters()}
    named.update({k: v for k, v in fused.named_buffers()})
    assert "blocks.0.conv1.synapse.weight" in named
    fused.load_state_dict(named, strict=True)
    # A wrong key is still an error.
    broken = dict(other.state_dict())
    broken["blocks.0.bn1.bogus"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        fused.load_state_dict(broken, strict=True)


@pytest.mark.parametrize("duplicate", ["deepcopy", "pickle", "torch.save"])
def test_copies_keep_the_unfused_keys(duplicate, tmp_path):
    torch.manual_seed(0)
    fused = fuse(randomized(Net()))
    if duplicate == "deepcopy":
        again = copy.deepcopy(fused)
    elif duplicate == "pickle":
        again = pickle.loads(pickle.dumps(fused))
    else:
        torch.save(fused, tmp_path / "m.pt")
        again = torch.load(tmp_path / "m.pt", weights_only=False)
    assert list(again.state_dict()) == list(fused.state_dict())
    again.load_state_dict(fused.state_dict(), strict=True)


@pytest.mark.parametrize("copied", ["fused", "deepcopy", "pickle", "pickle+deepcopy"])
@pytest.mark.parametrize("inplace", [False, True])
def test_a_dropped_model_is_freed_at_once(inplace, copied):
    """fx's tracer and a rewritten forward's GraphModule sit in reference cycles; fuse breaks
    them, so a model the user drops (its modules and parameters, a CUDA graph captured from
    it) is freed at once, not at the next full garbage collection (a dropped fused model's
    graph pool was once held until then). Net's blocks have rewritten forwards. A copy
    unpickled (torch.load of a whole model) once traced its code again on load, in a cycle."""
    gc.collect()
    gc.disable()
    try:
        net = Net()
        fused = fuse(net, inplace=inplace)
        if "pickle" in copied:
            net = fused = pickle.loads(pickle.dumps(fused))
        if "deepcopy" in copied:
            net = fused = copy.deepcopy(fused)
        refs = [weakref.ref(t) for t in (net, *fused.modules(), *fused.parameters())]
        del net, fused
        alive = sum(ref() is not None for ref in refs)
        assert alive == 0, f"{alive} of {len(refs)} modules and parameters outlive the model"
    finally:
        gc.enable()


class Stages(nn.Module):
    """Residual stages written out in the model's own forward, two more ops each."""

    def __init__(self, stages: int) -> None:
        super().__init__()
        self.convs = nn.ModuleList(conv() for _ in range(stages))
        self.bns = nn.ModuleList(bn() for _ in range(stages))
        self.sns = nn.ModuleList(lif() for _ in range(stages))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for synapse, norm, node in zip(self.convs, self.bns, self.sns, strict=True):
            x = node(norm(synapse(x)) + x) * 1.0 + 0.0
        return x


@pytest.mark.parametrize("duplicate", ["deepcopy", "pickle"])
def test_copied_rewritten_forwards_run_on_their_own_modules(duplicate):
    """A copy's rewritten forwards share its modules' dicts (a child replaced later is the one
    they call) and keep their class names, as fuse made them."""
    fused = fuse(Net())
    twin = copy.deepcopy(fused) if duplicate == "deepcopy" else pickle.loads(pickle.dumps(fused))
    rewritten = [m for m in twin.modules() if "forward" in m.__dict__]
    assert len(rewritten) == 2
    for module in rewritten:
        graph_module = module.__dict__["forward"].__self__
        for attribute in ("_modules", "_parameters", "_buffers"):
            assert graph_module.__dict__[attribute] is module.__dict__[attribute]
        assert type(graph_module).__name__ == type(module).__name__


def test_a_long_rewritten_forward_pickles():
    """A forward of a few hundred fx nodes (its own residual stages) pickles and loads: the
    graph goes as a flat list of nodes, not as fx's linked nodes, which pickle would walk
    recursively past Python's recursion limit."""

    torch.manual_seed(0)
    fused = fuse(randomized(Stages(120)), inplace=True)
    assert len(fused.__dict__["forward"].__self__.graph.nodes) > 300
    x = torch.randn(T, B, C, 6, 6, dtype=torch.float64)
    want = fused(x)
    functional.reset_net(fused)
    torch.testing.assert_close(pickle.loads(pickle.dumps(fused))(x), want, **FP64_TOL)


def test_report_names_every_reason_a_chain_is_left_unfused(caplog):
    """store_v_seq, Izhikevich, 's' mode and Dropout between layers were skipped
    without a word; ModuleList models were not fused at all."""
    rows = [
        [conv(3, C), bn(), lif(store_v_seq=True)],
        [conv(), bn(), neuron.IzhikevichNode(step_mode="m", backend="torch")],
        [conv(), bn(), neuron.LIFNode(step_mode="s", backend="torch")],
        [conv(), bn(), layer.Dropout(0.5, step_mode="m"), lif()],
        [conv(step_mode="s"), lif()],
    ]
    model = nn.Sequential(*(module for row in rows for module in row))

    class Looping(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model
            self.layers = nn.ModuleList([conv(), bn(), lif()])

        def forward(self, x):
            x = self.body(x)
            for m in self.layers:
                x = m(x)
            return x

    with caplog.at_level(logging.INFO, logger="spikefuse.fuse"):
        fused, report = fuse(Looping(), return_report=True)
    reasons = {s.modules: s.reason for s in report.skipped}
    assert reasons[("body.0", "body.1", "body.2")] == (
        "the neuron has store_v_seq=True; fused blocks never keep V"
    )
    assert "IzhikevichNode has two states" in reasons[("body.3", "body.4", "body.5")]
    assert "step_mode='s'" in reasons[("body.6", "body.7", "body.8")]
    assert reasons[("body.9", "body.10")] == "the output of 'body.10' goes to 'body.11'"
    assert "step_mode='s'" in reasons[("body.13", "body.14")]
    assert [c.modules for c in report.fused] == [("layers.0", "layers.1", "layers.2")]
    assert isinstance(fused.layers[0], FusedBlock) and not report.untraced
    assert report.chains == 5 and report.fused_fraction == pytest.approx(0.2)
    assert "fused 1 of 5" in str(report) and "store_v_seq" in str(report)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "4 of 5 chains were not fused" in warnings[0].getMessage()
    assert any("fused 1 of 5" in r.getMessage() for r in caplog.records if r.levelno == 20)


def test_untraceable_forward_falls_back_to_the_module_tree():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(conv(3, C), bn(), lif())
            self.extra = Block()
            self.conv, self.bn, self.sn = conv(), bn(), lif()

        def forward(self, x):
            x = self.extra(self.features(x))
            if x.sum() > 0:  # control flow on a value: torch.fx cannot trace this
                x = self.sn(self.bn(self.conv(x)))
            return x

    torch.manual_seed(0)
    model = randomized(DataDependent())
    fused, report = fuse(model, return_report=True)
    assert list(report.untraced) == ["<model>"]
    assert "TraceError" in report.untraced["<model>"] or "Proxy" in report.untraced["<model>"]
    assert report.traced == ["features", "extra"]
    assert {c.modules[0] for c in report.fused} == {"features.0", "extra.conv1", "extra.conv2"}
    unknown = next(s for s in report.skipped if s.modules == ("conv",))
    assert unknown.is_chain is None and "could not be traced" in unknown.reason
    assert report.fused_fraction == pytest.approx(3 / 4)
    assert isinstance(fused.conv, layer.Conv2d)
    x = torch.rand(T, B, 3, 6, 6, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)


def test_untraceable_sequential_is_searched_in_order():
    class Picky(nn.Module):
        def forward(self, x):
            if x.dim() != 5:  # fine eagerly, untraceable
                raise ValueError("expected [T, B, C, H, W]")
            return x

    model = nn.Sequential(Picky(), conv(3, C), bn(), lif())
    fused, report = fuse(model, return_report=True)
    assert set(report.untraced) == {"<model>", "0"}
    assert [c.modules for c in report.fused] == [("1", "2", "3")]
    assert isinstance(fused[1], FusedBlock)


def test_chains_that_must_not_be_fused():
    class Tricky(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.a_bn, self.a_sn = conv(), bn(), lif()  # conv called twice
            self.b, self.b_bn, self.b_sn = conv(), bn(), lif()  # BN output used twice
            self.c, self.c_bn, self.c_sn = conv(), bn(), lif()  # BN only in training
            self.d, self.d_bn, self.d_sn = conv(), bn(), lif()  # reads d.weight
            self.e, self.e_bn, self.e_sn = conv(), bn(), lif()  # a hook on e_bn
            self.f, self.f_bn, self.f_sn = conv(), bn(), lif()  # a backward hook on f_sn

        def forward(self, x):
            x = self.a_sn(self.a_bn(self.a(x))) + self.a(x)
            y = self.b_bn(self.b(x))
            x = self.b_sn(y) + y
            y = self.c(x)
            if self.training:
                y = self.c_bn(y)
            x = self.c_sn(y)
            x = self.d_sn(self.d_bn(self.d(x))) * self.d.weight.sum()
            x = self.e_sn(self.e_bn(self.e(x)))
            return self.f_sn(self.f_bn(self.f(x)))

    model = Tricky()
    seen = []
    model.e_bn.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    model.f_sn.register_full_backward_hook(lambda m, gi, go: seen.append(go))
    fused, report = fuse(model, return_report=True)
    assert not report.fused
    reasons = {s.modules[0]: s.reason for s in report.skipped}
    assert reasons["a"] == "'a' is called 2 times in the forward"
    assert reasons["b"] == "the output of 'b_bn' goes to 'b_sn', add()"
    assert reasons["c"] == (
        "the forward calls these modules differently in training mode and in eval mode"
    )
    assert reasons["d"] == "the forward reads 'd.weight' directly"
    assert reasons["e"] == "'e_bn' has forward hooks, which fusing would bypass"
    assert reasons["f"] == "'f_sn' has backward hooks, which fusing would bypass"
    assert all(s.is_chain for s in report.skipped)


def test_shared_module_is_not_fused():
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.sn = conv(3, C), bn(), lif()
            self.alias = self.sn  # the same neuron under a second name, not called

        def forward(self, x):
            return self.sn(self.bn(self.conv(x)))

    fused, report = fuse(Aliased(), return_report=True)
    assert not report.fused
    assert "registered under several names" in report.skipped[0].reason


def test_seq_to_ann_container_forms_in_a_custom_forward():
    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = layer.SeqToANNContainer(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C))
            self.sn = lif()
            self.fc = layer.SeqToANNContainer(nn.Linear(C * 16, 6))
            self.fc_bn = layer.SeqToANNContainer(nn.BatchNorm1d(6))
            self.fc_sn = lif()

        def forward(self, x):
            x = self.sn(self.conv(x)).flatten(2)
            return self.fc_sn(self.fc_bn(self.fc(x)))

    torch.manual_seed(0)
    model = randomized(Wrapped())
    fused, report = fuse(model, return_report=True)
    assert report.fused_fraction == 1.0 and len(report.fused) == 2
    assert isinstance(fused.conv, FusedBlock) and isinstance(fused.fc_bn, nn.Identity)
    assert list(fused.state_dict()) == list(model.state_dict())
    assert "conv.1.running_mean" in model.state_dict()
    x = torch.randn(T, B, 3, 4, 4, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)
    fused.load_state_dict(model.state_dict(), strict=True)
    model.load_state_dict(fused.state_dict(), strict=True)


@pytest.mark.parametrize(
    "args, match",
    [
        (("hello",), "fuse: model must be a torch.nn.Module, got str"),
        ((None,), "got NoneType"),
        ((nn.Sequential(), "yes"), "inplace must be a bool, got str"),
        ((nn.Sequential(), False, "group"), "process_group must be a torch.distributed"),
    ],
)
def test_bad_arguments_are_type_errors(args, match):
    with pytest.raises(TypeError, match=match):
        fuse(*args)


def test_inplace_and_leaf_models():
    model = nn.Sequential(conv(3, C), bn(), lif())
    assert fuse(model, inplace=True) is model and isinstance(model[0], FusedBlock)
    again, report = fuse(model, return_report=True)  # already fused: nothing left to do
    assert not report.fused and not report.skipped and report.fused_fraction == 1.0
    single, report = fuse(conv(), return_report=True)
    assert isinstance(single, layer.Conv2d) and not report.traced


def test_inplace_fuse_that_raises_leaves_the_model_as_it_was():
    """A chain whose block cannot be built is found after earlier chains fused: in place, the
    error still comes before the first change, and a logged report only for the real pass."""
    model = nn.Sequential(conv(3, C), bn(), lif(), conv(), bn(C + 1), lif())
    kinds = [type(m) for m in model]
    weights = [p.clone() for p in model.parameters()]
    with pytest.raises(SpikefuseError, match="BatchNorm has 5 features, the Conv2d produces 4"):
        fuse(model, inplace=True)
    assert [type(m) for m in model] == kinds
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), weights, strict=True))
    assert not model._state_dict_hooks and not model._load_state_dict_pre_hooks
    model[4] = bn()
    assert fuse(model, inplace=True) is model and isinstance(model[3], FusedBlock)
    assert isinstance(model[0], FusedBlock)


def test_inplace_fuse_of_a_model_that_cannot_be_copied_warns_and_fuses(caplog):
    model = nn.Sequential(conv(3, C), bn(), lif())
    model.lock = threading.Lock()  # deepcopy cannot copy a lock
    with caplog.at_level(logging.WARNING, logger="spikefuse.fuse"):
        assert fuse(model, inplace=True) is model and isinstance(model[0], FusedBlock)
    assert "cannot be copied (TypeError" in caplog.text and "partly fused" in caplog.text


def test_train_and_eval_on_one_fused_module_reach_what_they_reached_unfused():
    """The block stands at the synapse's place: ``model[0].eval()`` freezes only the synapse
    (the BatchNorm keeps batch statistics and updates its running ones), ``model[1].eval()``
    the BatchNorm, as unfused; ``model.eval()`` reaches every part."""
    torch.manual_seed(0)
    ref = nn.Sequential(conv(3, C), bn(), lif()).double()
    fused = fuse(ref)
    x = torch.randn(T, B, 3, 5, 5, dtype=torch.float64)
    for index in (0, 1):
        ref.train(), fused.train()
        ref[index].eval(), fused[index].eval()
        (out_r, gx_r, gp_r), (out_f, gx_f, gp_f) = training_step(ref, x), training_step(fused, x)
        torch.testing.assert_close(out_f, out_r, **FP64_TOL)
        torch.testing.assert_close(gx_f, gx_r, **FP64_TOL)
        torch.testing.assert_close(gp_f, gp_r, **FP64_TOL)
        torch.testing.assert_close(fused[0].bn.running_mean, ref[1].running_mean, **FP64_TOL)
        assert fused[0].bn.training == ref[1].training
    fused.eval()
    assert not any(m.training for m in fused.modules())
    block = FusedBlock(nn.Conv2d(3, C, 3), nn.BatchNorm2d(C), lif()).eval()
    assert not any(m.training for m in block.modules())  # made directly: eval() reaches all


def test_a_chain_in_one_mode_only_is_not_fused():
    class TrainOnlyNeuron(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.sn = conv(3, C), bn(), lif()

        def forward(self, x):
            x = self.bn(self.conv(x))
            return self.sn(x) if self.training else x

    model = TrainOnlyNeuron()
    fused, report = fuse(model, return_report=True)
    assert not report.fused and report.skipped[0].is_chain
    assert report.skipped[0].reason == (
        "the forward calls these modules differently in training mode and in eval mode "
        "(the output of 'bn' goes to the forward's return value)"
    )
    assert model.training  # the training flags are restored after tracing
    model.eval()
    fuse(model)
    assert not model.training and not model.bn.training


def test_optional_forward_arguments_are_traced_both_ways():
    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.sn = conv(3, C), bn(), lif()
            self.conv2, self.bn2, self.sn2 = conv(), bn(), lif()

        def forward(self, x, skip=None):
            x = self.sn(self.bn(self.conv(x)))  # the same either way: fused
            y = self.bn2(self.conv2(x))
            return self.sn2(y) if skip is not None else y + x

    torch.manual_seed(0)
    model = randomized(Optional())
    fused, report = fuse(model, return_report=True)
    assert [c.modules for c in report.fused] == [("conv", "bn", "sn")]
    assert report.skipped[0].reason == (
        "the forward calls these modules differently in training mode and in training mode "
        "with default arguments (the output of 'bn2' goes to add())"
    )
    x = torch.rand(T, B, 3, 4, 4, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)


class _ReadsPotential(nn.Module):
    """A forward that fx cannot trace (so fuse() converts its children one by one) and that
    reads its neuron's membrane potential after the call."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(conv(3, C), bn(), lif())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spikes = self.body(x)
        if spikes.sum() < 0:  # data-dependent control flow: not traceable
            raise AssertionError("spikes are 0 or 1")
        return spikes, self.body[2].v


def test_reading_a_fused_modules_attribute_names_the_block():
    """A forward reading a fused neuron's .v failed with "'Identity' object has no
    attribute 'v'"; it now names the module, the block and why (no per-step potentials)."""
    model = _ReadsPotential()
    x = torch.randn(T, B, 3, 6, 6)
    model(x)  # unfused: fine
    fused, report = fuse(model, return_report=True)
    assert [chain.modules for chain in report.fused] == [("body.0", "body.1", "body.2")]
    with pytest.raises(
        SpikefuseError, match=r"'body\.2' was fused into the FusedBlock at 'body\.0'"
    ):
        fused(x)
    with pytest.raises(AttributeError, match="do not expose per-step potentials"):
        _ = fused.body[2].v
    with pytest.raises(
        AttributeError, match=r"'body\.1\.running_mean'.*BatchNorm is 'body\.0\.bn'"
    ):
        _ = fused.body[1].running_mean
    assert not hasattr(fused.body[2], "v")


# ---- residual chains: Conv -> BN -> (+ shortcut) -> neuron ------------------------------------
class ResidualBlock(nn.Module):
    """conv -> [bn] -> (+ shortcut) -> neuron, the addition written as ``form``."""

    def __init__(self, form: str = "out + x", with_bn: bool = True) -> None:
        super().__init__()
        self.conv1, self.bn1, self.sn1 = conv(), bn(), lif()
        self.conv2, self.bn2, self.sn2 = conv(), bn() if with_bn else None, lif()
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv2(self.sn1(self.bn1(self.conv1(x))))
        if self.bn2 is not None:
            out = self.bn2(out)
        if self.form == "out + x":
            out = out + x
        elif self.form == "x + out":
            out = x + out
        elif self.form == "+=":
            out += x
        elif self.form == "torch.add":
            out = torch.add(out, x)
        else:
            out = out.add(x)
        return self.sn2(out)


class ResidualNet(nn.Module):
    def __init__(self, form: str = "out + x", with_bn: bool = True) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv(3, C), bn(), lif())
        self.blocks = nn.Sequential(ResidualBlock(form, with_bn), ResidualBlock(form, with_bn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.stem(x)).mean((3, 4))


@pytest.mark.parametrize(
    ("form", "memory"),
    [("out + x", "default"), ("x + out", "default"), ("+=", "min"), ("torch.add", "default")]
    + [(".add", "min")],
)
def test_residual_chains_fuse_by_rewriting_the_forward(form, memory):
    """Both blocks' conv2 -> bn2 -> (+ x) -> sn2 become one FusedBlock called with the shortcut
    (the second block's shortcut is the first's fused spikes: kept 1-bit packed); the class
    stays, and so do the state_dict keys and every result, in both memory modes."""
    torch.manual_seed(0)
    model = randomized(ResidualNet(form))
    fused, report = fuse(model, return_report=True, memory=memory)
    residual = [c.modules for c in report.fused if c.residual]
    assert residual == [(f"blocks.{i}.conv2", f"blocks.{i}.bn2", f"blocks.{i}.sn2") for i in (0, 1)]
    assert report.fused_fraction == 1.0 and report.rewritten == ["blocks.0", "blocks.1"]
    block = fused.blocks[1]
    assert type(block) is ResidualBlock and block.conv2.residual
    assert isinstance(block.bn2, nn.Identity) and isinstance(block.sn2, nn.Identity)
    assert list(fused.state_dict()) == list(model.state_dict())
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)
    fused.train()
    want = fused(x)
    functional.reset_net(fused)
    for twin in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
        torch.testing.assert_close(twin(x), want, **FP64_TOL)


def test_residual_chain_without_batchnorm_and_in_the_model_own_forward():
    """conv -> (+ x) -> neuron in the forward of the model passed to fuse (inplace too)."""
    torch.manual_seed(0)
    model = randomized(ResidualBlock(with_bn=False))
    reference = copy.deepcopy(model)
    fused, report = fuse(model, inplace=True, return_report=True)
    assert fused is model and type(fused) is ResidualBlock
    assert [c.modules for c in report.fused if c.residual] == [("conv2", "sn2")]
    assert report.rewritten == ["<model>"]
    assert_equivalent(reference, fused, torch.randn(T, B, C, 8, 8, dtype=torch.float64) * 2)


def test_residual_chain_of_a_forward_that_differs_by_mode_stays_unfused():
    class ByMode(ResidualBlock):
        def forward(self, x):
            out = self.bn2(self.conv2(self.sn1(self.bn1(self.conv1(x)))))
            return self.sn2(out + (x if self.training else 0.5 * x))

    torch.manual_seed(0)
    model = randomized(ByMode())
    fused, report = fuse(model, return_report=True)
    skipped = {s.modules: s.reason for s in report.skipped}
    assert "differs between training and eval mode" in skipped[("conv2", "bn2", "sn2")]
    assert isinstance(fused.conv2, layer.Conv2d) and not report.rewritten
    assert_equivalent(model, fused, torch.randn(T, B, C, 8, 8, dtype=torch.float64) * 2)


@pytest.mark.parametrize("tensor", ["attribute", "constant"])
def test_residual_chain_of_a_forward_reading_plain_tensors_stays_unfused(tensor):
    """A forward that reads a tensor that is no parameter, buffer or submodule (a plain
    attribute, or a constant it makes, which fx's tracer stores on the module) is not
    rewritten: the rewritten forward runs on the module's parameters, buffers and submodules,
    and failed on its first call. The tracer's constants do not stay on the model."""

    class ReadsTensor(ResidualBlock):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.tensor(0.5, dtype=torch.float64)

        def forward(self, x):
            out = self.bn2(self.conv2(self.sn1(self.bn1(self.conv1(x)))))
            scale = self.scale if tensor == "attribute" else torch.tensor(0.5, dtype=torch.float64)
            return self.sn2(out + x * scale)

    torch.manual_seed(0)
    model = randomized(ReadsTensor())
    attributes = set(model.__dict__)
    fused, report = fuse(model, return_report=True)
    skipped = {s.modules: s.reason for s in report.skipped}
    assert (
        "reads tensors that are no parameter, buffer or submodule"
        in skipped[("conv2", "bn2", "sn2")]
    )
    assert not report.rewritten and set(fused.__dict__) == set(model.__dict__) == attributes
    assert_equivalent(model, fused, torch.randn(T, B, C, 8, 8, dtype=torch.float64) * 2)


def test_residual_blocks_check_their_call_before_any_state_changes():
    block = FusedBlock(conv(), bn(), lif(), residual=True).double()
    x = torch.rand(T, B, C, 6, 6, dtype=torch.float64)
    with pytest.raises(SpikefuseError, match=r"call it as block\(x, shortcut\)"):
        block(x)
    with pytest.raises(SpikefuseError, match="residual=True"):
        FusedBlock(conv(), bn(), lif()).double()(x, x)
    with pytest.raises(SpikefuseError, match="residual must be a bool"):
        FusedBlock(conv(), bn(), lif(), residual="yes")
    running = block.bn.running_mean.clone()
    with pytest.raises(SpikefuseError, match="shaped like the synapse output"):
        block(x, x[:, :, :, :3])
    with pytest.raises(SpikefuseError, match="floating point"):
        block(x, torch.ones(x.shape, dtype=torch.int64))
    assert torch.equal(block.bn.running_mean, running) and block.bn.num_batches_tracked == 0


@pytest.mark.parametrize("memory", ["default", "min"])
def test_a_shortcut_edited_in_place_before_backward_is_refused(memory):
    """A residual block keeps its shortcut through autograd's saved tensors: editing it in
    place between forward and backward raises instead of giving wrong gradients."""
    block = FusedBlock(conv(), bn(), lif(), memory=memory, residual=True).double()
    x = torch.rand(T, B, C, 6, 6, dtype=torch.float64)
    shortcut = torch.rand(T, B, C, 6, 6, dtype=torch.float64, requires_grad=True) * 1.0
    out = block(x, shortcut)
    with torch.no_grad():
        shortcut.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_compiled_residual_network_is_one_graph_with_the_eager_results():
    torch.manual_seed(0)
    fused = fuse(randomized(ResidualNet()).float())
    eager = copy.deepcopy(fused)
    x = torch.randn(T, B, 3, 8, 8) * 2

    def step(net: nn.Module) -> list[torch.Tensor]:
        out = net(x)
        out.square().sum().backward()
        return [out.detach(), *(p.grad for p in net.parameters())]

    torch.compiler.reset()
    explanation = torch._dynamo.explain(copy.deepcopy(fused))(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    got, want = step(compiled), step(eager)
    torch.compiler.reset()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def downsampling_net() -> nn.Sequential:
    """A stem and a Spiking ResNet basic block with a Conv1x1 -> BN downsample branch."""
    downsample = nn.Sequential(layer.Conv2d(C, 2 * C, 1, 2, bias=False, step_mode="m"), bn(2 * C))
    block = models.BasicBlock(
        C, 2 * C, 2, downsample, spiking_neuron=neuron.LIFNode, step_mode="m", backend="torch"
    )
    return randomized(nn.Sequential(conv(3, C), bn(), lif(), block))


def test_unfused_synapses_recompute_the_fused_spikes_they_read():
    """The downsample convolution is no chain (its BN output is the residual chain's shortcut),
    but it reads the stem's fused spikes: it saves them as their recipe, not as a tensor."""
    torch.manual_seed(0)
    model = downsampling_net()
    fused, report = fuse(model, return_report=True)
    assert report.recomputed_inputs == ["3.downsample.0"]
    assert report.fused_fraction == 1.0 and len(report.fused) == 3
    x = torch.randn(T, B, 3, 8, 8, dtype=torch.float64) * 2
    assert_equivalent(model, fused, x)
    stem = {}
    fused[0].register_forward_hook(lambda m, a, out: stem.update(ptr=out.data_ptr()))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.data_ptr()) or t, lambda t: t
    ):
        fused.train()(x)
    assert stem["ptr"] not in saved  # every reader of the stem's spikes recomputes them
    again = fuse(fused, return_report=True)[1]  # hooks are put on once
    assert not again.recomputed_inputs and len(fused[3].downsample[0]._forward_hooks) == 1


def test_compiled_downsampling_network_is_one_graph():
    torch.manual_seed(0)
    fused = fuse(downsampling_net().float())
    x = torch.randn(T, B, 3, 8, 8)
    want = fused(x)
    functional.reset_net(fused)
    torch.compiler.reset()
    explanation = torch._dynamo.explain(fused)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    got = torch.compile(fused, fullgraph=True, backend="aot_eager")(x)
    torch.compiler.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_set_step_mode_refuses_single_step_on_a_fused_model():
    model = fuse(Net())
    with pytest.raises(SpikefuseError, match=r"FusedBlock supports step_mode \('m',\), not 's'"):
        functional.set_step_mode(model, "s")
    assert all(getattr(m, "step_mode", "m") == "m" for m in model.modules())
    functional.set_step_mode(model, "m")


def test_missing_keys_are_named_as_the_state_dict_names_them():
    fused = fuse(Net())
    state = fused.state_dict()
    del state["blocks.0.conv1.weight"], state["stem.1.running_mean"]
    with pytest.raises(RuntimeError, match=r'"stem.1.running_mean", "blocks.0.conv1.weight"'):
        fused.load_state_dict(state)
    wrapped = nn.Sequential(fused)  # the fused chains' owners sit under a prefix here
    result = wrapped.load_state_dict({f"0.{k}": v for k, v in state.items()}, strict=False)
    assert result.missing_keys == ["0.stem.1.running_mean", "0.blocks.0.conv1.weight"]


def test_unexpected_keys_and_size_mismatches_are_named_as_the_state_dict_names_them():
    fused = fuse(Net())
    state = fused.state_dict()
    state["blocks.0.conv1.weight"], state["blocks.0.bn1.extra"] = torch.zeros(1), torch.zeros(1)
    with pytest.raises(RuntimeError) as raised:
        fused.load_state_dict(state)
    assert 'Unexpected key(s) in state_dict: "blocks.0.bn1.extra"' in str(raised.value)
    assert "size mismatch for blocks.0.conv1.weight: copying" in str(raised.value)
    wrapped = nn.Sequential(fused)
    del state["blocks.0.conv1.weight"]
    result = wrapped.load_state_dict({f"0.{k}": v for k, v in state.items()}, strict=False)
    assert result.unexpected_keys == ["0.blocks.0.bn1.extra"]
    assert result.missing_keys == ["0.blocks.0.conv1.weight"]
    fused.load_state_dict(fused.state_dict())  # nothing stale from the failed loads


def test_an_entry_under_both_names_is_refused_not_picked():
    """A state dict holding a fused chain's tensor under its unfused and its fused key: which
    one to load is the user's choice, strict or not."""
    fused = fuse(Net())
    state = fused.state_dict()
    state["blocks.0.conv1.synapse.weight"] = state["blocks.0.conv1.weight"] + 1.0
    for strict in (True, False):
        with pytest.raises(RuntimeError, match="both 'blocks.0.conv1.weight' .* keep one"):
            fused.load_state_dict(state, strict=strict)


class ApartBlock(nn.Module):
    """Registers every conv, then every BatchNorm, then every neuron (a common style)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv(), conv()
        self.bn1, self.bn2 = bn(), bn()
        self.sn1, self.sn2 = lif(), lif()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sn2(self.bn2(self.conv2(self.sn1(self.bn1(self.conv1(x))))))


def test_state_dict_keeps_the_unfused_order_and_a_changed_parameter_order_is_reported(caplog):
    model = ApartBlock()
    with caplog.at_level(logging.WARNING, logger="spikefuse.fuse"):
        fused = fuse(model)
    assert list(fused.state_dict()) == list(model.state_dict())
    wrapped = nn.Sequential(fused)
    assert list(wrapped.state_dict()) == [f"0.{k}" for k in model.state_dict()]
    assert "parameters() now lists the parameters in another order" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spikefuse.fuse"):
        fuse(Net())  # each chain registered together: the same order
    assert "another order" not in caplog.text


def test_an_eval_model_stays_in_eval_mode():
    fused = fuse(Net().eval())
    assert not any(m.training for m in fused.modules())
    assert all(m.training for m in fuse(Net()).modules())


def test_hooks_of_fused_models_pickled_before_the_key_order_still_save():
    """Hooks unpickled from earlier versions lack the attributes added since (rank, prefix)."""
    from spikefuse.fused import convert

    fused = fuse(Net())
    for module in fused.modules():
        for hook in module._state_dict_hooks.values():
            if isinstance(hook, convert._SaveUnderOriginalNames):
                del hook.__dict__["rank"]
    assert list(fused.state_dict()) == list(Net().state_dict())
    fused.load_state_dict(Net().state_dict())


class ScaledLIF(neuron.LIFNode):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_neuron_overriding_forward_stays_unfused():
    model = nn.Sequential(conv(), bn(), ScaledLIF(tau=2.0, step_mode="m", backend="torch"))
    fused, report = fuse(model, return_report=True)
    assert not report.fused and "ScaledLIF overrides forward" in report.skipped[0].reason
    with pytest.raises(SpikefuseError, match="overrides forward"):
        FusedBlock(model[0], model[1], model[2])


def test_placeholders_refuse_writes_and_pass_train_and_eval_on():
    model = nn.Sequential(conv(), bn(), lif())
    fused = fuse(model)
    fused[1].eval()  # freezes the BatchNorm in the block, as model[1].eval() would unfused
    assert not fused[0].bn.training and fused[0].training
    fused.train()
    assert fused[0].bn.training
    with pytest.raises(AttributeError, match=r"set '0.node.v_threshold'"):
        fused[2].v_threshold = 0.1
    assert pickle.loads(pickle.dumps(fused))[1]._target is not None
    twin = copy.deepcopy(fused)
    assert twin[1]._target is twin[0].bn


class Recording(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.sn = conv(), bn(), lif()
        self.calls, self.rates = 0, []

    def forward(self, x):
        self.calls += 1
        out = self.sn(self.bn(self.conv(x)))
        self.rates.append(out.mean())
        return out


def test_tracing_leaves_what_the_forward_writes_as_it_was():
    model = Recording()
    fused = fuse(model)
    assert fused.calls == 0 and fused.rates == []
    fused(torch.rand(T, B, C, 6, 6))
    assert fused.calls == 1 and len(fused.rates) == 1


def test_fused_model_runs_under_inference_mode():
    torch.manual_seed(0)
    model = randomized(nn.Sequential(conv(), bn(), lif(), conv(), bn(), lif())).eval()
    fused = fuse(copy.deepcopy(model))
    x = torch.rand(T, B, C, 6, 6, dtype=torch.float64)
    with torch.inference_mode():
        got = fused(x)
        want = model(x)
    torch.testing.assert_close(got, want)


class BroadcastShortcut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.sn = conv(), bn(), lif()
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, C).view(C, 1, 1))

    def forward(self, x):
        return self.sn(self.bn(self.conv(x)) + self.offset)


def test_a_residual_that_broadcasts_is_expanded():
    torch.manual_seed(0)
    model = randomized(BroadcastShortcut())
    fused, report = fuse(copy.deepcopy(model), return_report=True)
    assert report.fused_fraction == 1.0
    x = torch.rand(T, B, C, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x), model(x), **FP64_TOL)


def test_batchnorm_without_running_statistics_uses_batch_statistics_in_eval():
    torch.manual_seed(0)
    model = randomized(nn.Sequential(conv(), bn(), lif()))
    model[1].running_mean = model[1].running_var = None
    model.eval()
    fused = fuse(copy.deepcopy(model))
    x = torch.rand(T, B, C, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(fused(x), model(x), **FP64_TOL)


def test_a_parametrized_conv_is_reported_as_such():
    model = nn.Sequential(conv(), bn(), lif())
    torch.nn.utils.parametrizations.weight_norm(model[0])
    report = fuse(model, return_report=True)[1]
    assert not report.fused and "parameters are parametrized" in report.skipped[0].reason


def test_placeholders_take_tags_that_are_not_the_fused_modules_attributes():
    fused = fuse(nn.Sequential(conv(), bn(), lif()))
    for module in fused.modules():  # e.g. torch.ao.quantization.propagate_qconfig_
        module.qconfig = None
    assert fused[1].qconfig is None


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.sn = conv(), bn(), lif()

    def forward(self, x):
        self.feat = x
        return self.sn(self.bn(self.conv(x)))


def test_tracing_removes_attributes_a_submodule_forward_adds():
    fused = fuse(nn.Sequential(Inner()))
    assert not hasattr(fused[0], "feat")
