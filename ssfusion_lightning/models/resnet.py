"""ResNet (He et al. 2016), v1.5: the stride of a bottleneck block sits on its 3x3 convolution."""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model


def _conv_bn(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(out_channels),
    ]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(in_channels, channels, 3, stride), nn.ReLU(inplace=True), *_conv_bn(channels, channels, 3)
        )
        self.shortcut = _shortcut(in_channels, channels * self.expansion, stride)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(in_channels, channels, 1),
            nn.ReLU(inplace=True),
            *_conv_bn(channels, channels, 3, stride),
            nn.ReLU(inplace=True),
            *_conv_bn(channels, out_channels, 1),
        )
        self.shortcut = _shortcut(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _shortcut(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(in_channels, out_channels, 1, stride))


_BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    """ResNet for images of shape (N, in_channels, H, W) -> logits (N, num_classes).

    ``stem="imagenet"``: 7x7 stride-2 convolution and max-pool (224px inputs);
    ``stem="cifar"``: a single 3x3 convolution, no pooling (32px inputs keep their resolution).
    ``width`` is the channel count of the first stage; stages double it.
    """

    def __init__(
        self,
        block: Literal["basic", "bottleneck"],
        layers: Sequence[int],
        num_classes: int = 1000,
        stem: Literal["imagenet", "cifar"] = "imagenet",
        width: int = 64,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if block not in _BLOCKS:
            raise ValueError(f"unknown block {block!r}; valid choices: {', '.join(_BLOCKS)}")
        block_cls = _BLOCKS[block]
        if stem == "imagenet":
            self.stem = nn.Sequential(
                *_conv_bn(in_channels, width, 7, stride=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1)
            )
        elif stem == "cifar":
            self.stem = nn.Sequential(*_conv_bn(in_channels, width, 3), nn.ReLU(inplace=True))
        else:
            raise ValueError(f"unknown stem {stem!r}; valid choices: imagenet, cifar")

        stages: list[nn.Module] = []
        channels_in = width
        for index, depth in enumerate(layers):
            channels = width * 2**index
            blocks = []
            for position in range(depth):
                stride = 2 if index > 0 and position == 0 else 1
                blocks.append(block_cls(channels_in, channels, stride))
                channels_in = channels * block_cls.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels_in, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        features = self.stages(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


def _sizes(block: str, layers: tuple[int, ...]) -> dict[str, dict[str, object]]:
    shape = {"block": block, "layers": layers}
    return {
        "tiny": {**shape, "num_classes": 10, "stem": "cifar", "width": 8},
        "cifar": {**shape, "num_classes": 10, "stem": "cifar"},
        "imagenet": {**shape, "num_classes": 1000, "stem": "imagenet"},
    }


register_model("resnet18", ResNet, _sizes("basic", (2, 2, 2, 2)))
register_model("resnet50", ResNet, _sizes("bottleneck", (3, 4, 6, 3)))
register_model("resnet152", ResNet, _sizes("bottleneck", (3, 8, 36, 3)))
