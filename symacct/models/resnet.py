"""A ResNet (He et al. 2015, the 18/34-layer "basic block" form) for image classification.

Stem: a 7x7 convolution of stride 2, batch norm, ReLU, a 3x3 max-pooling of
stride 2. Then four stages of basic blocks (two 3x3 convolutions with batch
norm, and the identity or a strided 1x1 projection as shortcut); stages 2-4
halve the image side and double the channels. Global average pooling and a
linear classifier; the loss is the cross-entropy of one label per image.

Symbols: B images of S x S pixels, ``width`` channels in the first stage
(64 in ResNet-18), K classes. The image side is halved five times, so the
formulas hold where 32 divides S (224 = 32 * 7); ``derive`` learns that
constraint from the trace and refuses other sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ResNetConfig:
    width: int = 64  # channels of the first stage; stage i has width * 2**i
    num_classes: int = 1000  # K
    blocks: tuple[int, ...] = (2, 2, 2, 2)  # basic blocks per stage: ResNet-18 (3, 4, 6, 3: ResNet-34)
    channels: int = 3  # input channels (RGB)


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, c_in, s, s) -> (B, c_out, s / stride, s / stride)
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        w = config.width
        self.stem = nn.Sequential(
            nn.Conv2d(config.channels, w, 7, stride=2, padding=3, bias=False),  # (B, w, S/2, S/2)
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),  # (B, w, S/4, S/4)
        )
        stages = []
        c_in = w
        for i, n in enumerate(config.blocks):
            c_out = w * 2**i
            stride = 1 if i == 0 else 2  # stage i: (B, w * 2**i, S / 2**(i+2), S / 2**(i+2))
            blocks = [BasicBlock(c_in if j == 0 else c_out, c_out, stride if j == 0 else 1) for j in range(n)]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, config.num_classes)  # (8w, K)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # images: (B, channels, S, S), labels: (B,)
        x = self.stages(self.stem(images))  # (B, 8w, S/32, S/32)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)  # (B, 8w)
        return F.cross_entropy(self.head(x), labels)  # scalar

    def example_inputs(self, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """B images of S x S pixels and one label each."""
        c = self.config
        return torch.randn(B, c.channels, S, S), torch.randint(0, c.num_classes, (B,))
