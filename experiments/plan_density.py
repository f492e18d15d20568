"""The density each fusion policy's plan sends, before and after the plan's budget (issue 15).

    python -m experiments.plan_density

Every sparse tensor sends max(1, floor(density x n)) elements, so tensors smaller than 1 / density
send more than they ask for; ``fusion.budget.within_budget`` takes that excess back from the larger
tensors. This prints, for the time-to-accuracy models (the digits CNN and the byte-level LM) and
every per-tensor fusion policy at 1% and 0.1% with the presets' dgc sparsifier, the planned elements
over the sparse tensors' elements as the policy plans them and as the engine sends them. Plans only:
no training, a few seconds. Writes experiments/results/plan_density.md.
"""

from __future__ import annotations

import argparse

from experiments.common import publish_md
from ssfusion_lightning.costmodel import CostProfile
from ssfusion_lightning.fusion import FUSION_POLICIES, PlanContext
from ssfusion_lightning.fusion.budget import within_budget
from ssfusion_lightning.models import build_model
from ssfusion_lightning.sparsifiers import build_sparsifier
from ssfusion_lightning.vocabulary import ParamSpec, Plan

#: the time-to-accuracy workloads' models (experiments/e2e_worker.py WORKLOADS: digits, text)
MODELS = {"digits CNN": ("resnet18", "tiny"), "byte-level LM": ("gpt2", "tiny")}
POLICIES = ("selective", "ahead", "aligned", "adaptive", "partial", "layerwise", "behind")


def sent_density(plan: Plan) -> tuple[int, float]:
    """Sparse tensors, and their planned elements over their elements."""
    slots = [slot for buffer in plan.buffers for slot in buffer.sparse_slots]
    return len(slots), sum(slot.k for slot in slots) / max(1, sum(slot.numel for slot in slots))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="folder for the table (default experiments/results)")
    args = parser.parse_args()
    lines = [
        "| model | policy | density | sparse tensors | planned by the policy | sent (within the budget) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for label, (name, size) in MODELS.items():
        model = build_model(name, size)
        # backward order, as the engine plans before it has seen a backward
        specs = [(i, ParamSpec(n, tuple(p.shape), p.dtype)) for i, (n, p) in enumerate(reversed(list(model.named_parameters())))]
        for policy in POLICIES:
            for density in (0.01, 0.001):
                sparsifier = build_sparsifier("dgc", density=density)
                ctx = PlanContext(sparsifier, None, 2, 4, CostProfile(world_size=4))
                plan = FUSION_POLICIES.build(policy).plan(specs, ctx)
                count, planned = sent_density(plan)
                _, sent = sent_density(within_budget(plan, sparsifier))
                lines.append(f"| {label} | {policy} | {density:.1%} | {count} | {planned:.4%} | {sent:.4%} |")
    publish_md("\n".join(lines), "plan_density", args.out)


if __name__ == "__main__":
    main()
