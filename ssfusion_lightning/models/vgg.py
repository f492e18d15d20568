"""VGG (Simonyan & Zisserman 2015), optionally with BatchNorm after every convolution."""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model

# Channel multiples of ``width`` per 3x3 convolution; "M" is a 2x2 max-pool.
_VGG16 = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")
_VGG19 = (1, 1, "M", 2, 2, "M", 4, 4, 4, 4, "M", 8, 8, 8, 8, "M", 8, 8, 8, 8, "M")


class VGG(nn.Module):
    """VGG for images (N, in_channels, H, W) -> logits (N, num_classes).

    ``classifier_dim > 0`` gives the ImageNet head: features pooled to 7x7, then two hidden layers of
    ``classifier_dim`` units with dropout. ``classifier_dim == 0`` gives the usual CIFAR head: global
    average pooling and one linear layer.
    """

    def __init__(
        self,
        layers: Sequence[int | str],
        num_classes: int = 1000,
        batch_norm: bool = False,
        width: int = 64,
        classifier_dim: int = 4096,
        dropout: float = 0.5,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        features: list[nn.Module] = []
        channels = in_channels
        for item in layers:
            if item == "M":
                features.append(nn.MaxPool2d(2))
                continue
            out_channels = width * int(item)
            # Every convolution keeps its bias, BatchNorm or not, as in the reference layouts (torchvision's
            # vgg*/vgg*_bn and the usual CIFAR VGG): the plan sees the reference's tensors.
            features.append(nn.Conv2d(channels, out_channels, 3, padding=1))
            if batch_norm:
                features.append(nn.BatchNorm2d(out_channels))
            features.append(nn.ReLU(inplace=True))
            channels = out_channels
        self.features = nn.Sequential(*features)

        if classifier_dim > 0:
            self.pool = nn.AdaptiveAvgPool2d(7)
            self.classifier = nn.Sequential(
                nn.Linear(channels * 7 * 7, classifier_dim),
                nn.ReLU(inplace=True),
                nn.Dropout(dropout),
                nn.Linear(classifier_dim, classifier_dim),
                nn.ReLU(inplace=True),
                nn.Dropout(dropout),
                nn.Linear(classifier_dim, num_classes),
            )
        else:
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.classifier = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.pool(self.features(x)).flatten(1))


def _sizes(layers: tuple[int | str, ...]) -> dict[str, dict[str, object]]:
    # Without BatchNorm VGG trains poorly from scratch on CIFAR; the ImageNet size is the original network.
    return {
        "tiny": {"layers": layers, "num_classes": 10, "batch_norm": True, "width": 8, "classifier_dim": 0},
        "cifar": {"layers": layers, "num_classes": 10, "batch_norm": True, "classifier_dim": 0},
        "imagenet": {"layers": layers, "num_classes": 1000, "batch_norm": False, "classifier_dim": 4096},
    }


register_model("vgg16", VGG, _sizes(_VGG16))
register_model("vgg19", VGG, _sizes(_VGG19))
