"""Vision Transformer (Dosovitskiy et al. 2021): patch embedding, class token, pre-norm blocks."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ssfusion_lightning.models.factory import register_model
from ssfusion_lightning.models.transformer import TransformerBlock, init_transformer_weights


class VisionTransformer(nn.Module):
    """ViT for images (N, in_channels, image_size, image_size) -> logits (N, num_classes)."""

    def __init__(
        self,
        image_size: int = 224,
        patch_size: int = 16,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        dropout: float = 0.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} is not divisible by patch_size {patch_size}")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.Sequential(
            *(TransformerBlock(dim, num_heads, mlp_dim, dropout, norm_first=True, eps=1e-6) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        init_transformer_weights(self)
        nn.init.normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        patches = self.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), patches], dim=1)
        tokens = self.blocks(self.dropout(tokens + self.pos_embed))
        return self.head(self.norm(tokens[:, 0]))


def _paper(dim: int, depth: int, num_heads: int) -> dict[str, object]:
    # The /16 variants at 224px, ImageNet-1k head.
    return {"dim": dim, "depth": depth, "num_heads": num_heads, "mlp_dim": 4 * dim}


register_model(
    "vit",
    VisionTransformer,
    {
        "tiny": {"image_size": 32, "patch_size": 4, "num_classes": 10, "dim": 64, "depth": 2, "num_heads": 2,
                 "mlp_dim": 128},
        "small": _paper(384, 12, 6),
        "base": _paper(768, 12, 12),
        "large": _paper(1024, 24, 16),
    },
)
