"""Soak test: a long 2-rank run, killed at random points and resumed, must end bit-identical to an
uninterrupted run; resident memory must stay flat.

    python experiments/soak.py                 # 2000 steps, 5 kills (a few minutes on 2 cores)
    python experiments/soak.py --steps 300 --kills 2 --out /tmp/soak   # quick

Writes experiments/results/soak.{csv,md,png}: RSS per rank over steps (kill/resume points marked)
and the verdict. Each job is `python experiments/soak.py --job ...`, a Lightning run with the
`ssfusion` strategy (popen launcher: rank 1 is a child of rank 0), checkpointing every
--every steps; a kill takes the whole process group down with SIGKILL.
"""

from __future__ import annotations

import argparse
import csv
import glob
import os
import random
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "experiments", "results")


def rss_megabytes() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_job(args: argparse.Namespace) -> None:
    """One (possibly resumed) training job; rank 0 writes the final parameters."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn
    from torch.utils.data import TensorDataset

    import ssfusion_lightning as ssf
    from ssfusion_lightning.data import ResumableDataLoader

    torch.set_num_threads(1)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)

    class RSSLog(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 25 == 0:
                with open(os.path.join(args.dir, f"rss_rank{trainer.global_rank}.csv"), "a") as log:
                    log.write(f"{trainer.global_step},{rss_megabytes():.1f}\n")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 16, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
    L.seed_everything(0, verbose=False)
    model = Net()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(args.dir, "ckpt"), every_n_train_steps=args.every, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        # Timing-independent plan: cost-driven policies (selective, adaptive, partial, offload="auto")
        # freeze a plan from timings profiled online, so two separate runs may plan differently; a
        # resumed run restores its own frozen plan from the checkpoint (tests/test_strategy_lightning.py).
        strategy=ssf.SSFusionStrategy(sparsifier="dgc", density=0.05, fusion="aligned", comm="hybrid", offload="thread"),
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints, RSSLog()],
        default_root_dir=args.dir,
    )
    trainer.fit(model, ResumableDataLoader(data, batch_size=32, shuffle=True), ckpt_path=args.resume)
    if trainer.global_rank == 0:
        torch.save({n: p.detach() for n, p in model.named_parameters()}, os.path.join(args.dir, "final.pt"))


def newest_readable_checkpoint(directory: str) -> str | None:
    """A kill can interrupt a save: fall back to the newest checkpoint that loads."""
    import torch

    paths = sorted(glob.glob(os.path.join(directory, "ckpt", "step=*.ckpt")), key=checkpoint_step)
    for path in reversed(paths):
        try:
            torch.load(path, map_location="cpu")  # torch's safe default: checkpoints hold plain values only
            return path
        except Exception:  # noqa: BLE001 - a torn file is expected after SIGKILL
            continue
    return None


def checkpoint_step(path: str | None) -> int:
    return int(path.split("=")[-1][:-5]) if path else 0


def wait_for_progress(directory: str, resume: str | None, job: subprocess.Popen) -> bool:
    """Wait until the job wrote a checkpoint past the one it resumed from (False if it ended first)."""
    start = checkpoint_step(resume)
    while job.poll() is None:
        steps = [checkpoint_step(p) for p in glob.glob(os.path.join(directory, "ckpt", "step=*.ckpt"))]
        if steps and max(steps) > start:
            return True
        time.sleep(0.2)
    return False


def launch(directory: str, steps: int, every: int, resume: str | None) -> subprocess.Popen:
    command = [sys.executable, os.path.abspath(__file__), "--job", "--dir", directory, "--steps", str(steps), "--every", str(every)]
    if resume:
        command += ["--resume", resume]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    log = open(os.path.join(directory, "job.log"), "a")
    return subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def drive(args: argparse.Namespace) -> int:
    import torch

    rng = random.Random(args.seed)
    reference_dir = os.path.join(args.out, "reference")
    soak_dir = os.path.join(args.out, "killed")
    for directory in (reference_dir, soak_dir):
        os.makedirs(directory, exist_ok=True)
    if launch(reference_dir, args.steps, args.every, None).wait() != 0:
        raise SystemExit(f"the uninterrupted run failed: see {reference_dir}/job.log")

    kills: list[tuple[float, int]] = []
    resume = None
    while True:
        job = launch(soak_dir, args.steps, args.every, resume)
        if len(kills) < args.kills and wait_for_progress(soak_dir, resume, job):
            delay = rng.uniform(0.2, 3.0)  # lands anywhere between two checkpoints
            try:
                job.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
                resume = newest_readable_checkpoint(soak_dir)
                kills.append((delay, checkpoint_step(resume)))
                continue
        if job.wait() != 0:
            raise SystemExit(f"the resumed run failed: see {soak_dir}/job.log")
        break

    ours = torch.load(os.path.join(soak_dir, "final.pt"))
    reference = torch.load(os.path.join(reference_dir, "final.pt"))
    identical = ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)
    report(args, kills, identical, reference_dir, soak_dir)
    return 0 if identical else 1


def read_rss(directory: str, rank: int) -> list[tuple[int, float]]:
    path = os.path.join(directory, f"rss_rank{rank}.csv")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [(int(step), float(mb)) for step, mb in csv.reader(handle)]


def report(args, kills, identical, reference_dir, soak_dir) -> None:
    os.makedirs(args.results, exist_ok=True)
    rows = []
    for label, directory in (("uninterrupted", reference_dir), ("killed+resumed", soak_dir)):
        for rank in (0, 1):
            rows += [(label, rank, step, mb) for step, mb in read_rss(directory, rank)]
    with open(os.path.join(args.results, "soak.csv"), "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "rank", "step", "rss_mb"])
        writer.writerows(rows)
    lines = [
        "# Soak: kill and resume",
        "",
        f"Command: `python experiments/soak.py --steps {args.steps} --kills {args.kills} --every {args.every} --seed {args.seed}`",
        "",
        f"- steps: {args.steps}, checkpoint every {args.every} steps, 2 ranks, SSFusionStrategy(dgc, aligned, hybrid, offload thread)",
        f"- kills (SIGKILL of the whole job): {len(kills)}; resumed from steps {[step for _, step in kills]}",
        f"- final parameters bit-identical to the uninterrupted run: **{'yes' if identical else 'NO'}**",
    ]
    for label, directory in (("uninterrupted", reference_dir), ("killed+resumed", soak_dir)):
        for rank in (0, 1):
            samples = read_rss(directory, rank)
            if len(samples) >= 4:
                quarter = len(samples) // 4
                early = sum(mb for _, mb in samples[quarter : 2 * quarter]) / quarter
                late = sum(mb for _, mb in samples[-quarter:]) / quarter
                lines.append(f"- RSS {label} rank {rank}: {early:.0f} MB in the 2nd quarter, {late:.0f} MB in the last quarter ({late / early:.3f}x)")
    with open(os.path.join(args.results, "soak.md"), "w") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, directory in (("uninterrupted", reference_dir), ("killed+resumed", soak_dir)):
            for rank in (0, 1):
                samples = read_rss(directory, rank)
                ax.plot([s for s, _ in samples], [m for _, m in samples], ".", ms=3, label=f"{label} rank {rank}")
        for _, step in kills:
            ax.axvline(step, color="grey", lw=0.6, ls="--")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("RSS (MB)")
        ax.set_title("Soak: resident memory (dashed: resume points)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.results, "soak.png"), dpi=120)
    except ImportError:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="/tmp/ssfusion_soak", help="scratch directory for the runs")
    parser.add_argument("--results", default=RESULTS)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--resume", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        run_job(args)
        return 0
    if os.path.exists(args.out):
        import shutil

        shutil.rmtree(args.out)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
