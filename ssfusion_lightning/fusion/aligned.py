"""`aligned`: SAFusion inter-worker alignment.

Sparsification ahead of fusion with a fixed k_i per tensor (the same plan on every rank), and
threshold sparsifiers' selections trimmed or topped up to exactly k_i, so every rank sends exactly
sum(k_i) elements per buffer: the allgather needs no size exchange and no rank waits on a larger
payload.
"""

from __future__ import annotations

from ssfusion_lightning.fusion.ahead import AheadPolicy
from ssfusion_lightning.fusion.base import FUSION_POLICIES


@FUSION_POLICIES.register("aligned")
class AlignedPolicy(AheadPolicy):
    name = "aligned"
    aligned = True
