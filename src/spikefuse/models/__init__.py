"""Spiking VGG, Spiking ResNet, SEW-ResNet and ResNet-19 with SpikingJelly's names.

As in ``spikingjelly.activation_based.model``: the constructors take the neuron class as
``spiking_neuron`` and pass every other keyword argument to each neuron (a deep copy per
neuron), e.g. ``spiking_resnet18(spiking_neuron=neuron.LIFNode, tau=2.0, detach_reset=True)``;
layers are ``spikefuse.layer`` modules, so ``functional.set_step_mode(net, 'm')`` makes the
network multi-step (input ``[T, B, 3, H, W]``, output ``[T, B, num_classes]``). Extension: a
``step_mode`` keyword argument also sets the layers' step mode, so
``spiking_resnet18(spiking_neuron=neuron.IFNode, step_mode='m')`` is multi-step at once.

Every Conv/Linear → BatchNorm → neuron chain of these networks is fused by
:func:`spikefuse.fuse`, the residual ones (Conv → BN → + shortcut → neuron, the second half of a
Spiking ResNet block) too; a Conv → BN downsample branch feeding the addition stays unfused (it
is that chain's shortcut). No weights are downloaded: ``pretrained=True`` is refused.
"""

from __future__ import annotations

# the constants stay importable here, as before, without being star-exported
from ._resnet import CONNECT_FUNCTIONS as CONNECT_FUNCTIONS
from ._resnet import (
    BasicBlock,
    ResNet19,
    SEWBasicBlock,
    SEWResNet,
    SpikingResNet,
    sew_function,
    sew_resnet18,
    sew_resnet34,
    spiking_resnet18,
    spiking_resnet19,
    spiking_resnet34,
)
from ._vgg import VGG_CONFIGS as VGG_CONFIGS
from ._vgg import (
    SpikingVGG,
    spiking_vgg11,
    spiking_vgg11_bn,
    spiking_vgg16,
    spiking_vgg16_bn,
)

__all__ = [
    "BasicBlock",
    "ResNet19",
    "SEWBasicBlock",
    "SEWResNet",
    "SpikingResNet",
    "SpikingVGG",
    "sew_function",
    "sew_resnet18",
    "sew_resnet34",
    "spiking_resnet18",
    "spiking_resnet19",
    "spiking_resnet34",
    "spiking_vgg11",
    "spiking_vgg11_bn",
    "spiking_vgg16",
    "spiking_vgg16_bn",
]

# pickle (torch.save(model)) records a class or function by its __module__: keep the public
# path, so saved models load whichever private submodule defines the name.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
