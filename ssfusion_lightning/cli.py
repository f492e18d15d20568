"""``ssfusion-train``: the Hydra command line (config root ``conf/train.yaml``).

    ssfusion-train                                        # the default job: 2 CPU ranks, ssfusion, tiny ResNet
    ssfusion-train experiment=resnet152-imagenet-tiny     # a seed workload's tiny twin
    ssfusion-train -m sparsifier=topk,dgc fusion=ahead,selective   # a sweep, one summary table
    ssfusion-train --help                                 # the config groups and their options

Every job writes ``results.json`` into its Hydra output directory; a sweep also writes
``summary.csv`` and ``summary.md`` into its sweep directory. See docs/cli.md.
"""

from __future__ import annotations

from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ssfusion_lightning.app.config import CONFIG_NAME, config_dir, register_fallback_configs

# Before hydra.main composes: registered names without a yaml become group options too.
register_fallback_configs()


def job_info() -> dict[str, Any]:
    """The running Hydra job, as recorded in results.json."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "name": hc.job.name,
        "mode": hc.mode.name.lower(),
        "num": hc.job.get("num") if multirun else None,
        "overrides": list(hc.overrides.task),
        "output_dir": hc.runtime.output_dir,
        "sweep_dir": hc.sweep.dir if multirun else None,
    }


@hydra.main(config_path=str(config_dir()), config_name=CONFIG_NAME, version_base="1.3")
def main(cfg: DictConfig) -> dict[str, Any]:
    from lightning.pytorch.utilities import rank_zero_only

    from ssfusion_lightning.train import format_results, run

    job = job_info()
    # Resolve here: ${hydra:...} interpolations only resolve in the process that runs the Hydra job,
    # and spawned ranks are other processes.
    OmegaConf.resolve(cfg)
    results = run(cfg, job=job, multirun=job["mode"] == "multirun")
    if rank_zero_only.rank == 0:
        print(f"\n== {cfg.get('name')}: results in {job['output_dir']}/results.json")
        print(format_results(results))
    return results


if __name__ == "__main__":
    main()
