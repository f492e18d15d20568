"""Tests for experiments/cluster: the network-namespace cluster emulator.

Everything that creates namespaces needs root; those tests are skipped (with the reason)
when namespaces cannot be created here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from experiments.cluster import units

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "experiments.cluster"]


# ---------------------------------------------------------------- pure helpers (no root needed)
def test_parse_units():
    assert units.parse_rate("1gbit") == 10**9
    assert units.parse_rate("100mbit") == 10**8
    assert units.parse_rate("12.5mbps") == 10**8  # tc: bps = bytes/s
    assert units.parse_rate(5e6) == 5_000_000
    assert units.parse_time("0.5ms") == pytest.approx(5e-4)
    assert units.parse_time("200us") == pytest.approx(2e-4)
    assert units.parse_fraction("0.1%") == pytest.approx(1e-3)
    assert units.parse_fraction("0.02") == pytest.approx(0.02)
    for bad in ("fast", "1gbitz", "-1mbit"):
        with pytest.raises(ValueError):
            units.parse_rate(bad)
    with pytest.raises(ValueError):
        units.parse_fraction("150%")


# ---------------------------------------------------------------------------- root-only tests
def _support() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root: network namespaces / veth / tc need root"
    from experiments.cluster import probe_support

    res = probe_support()
    if not res.get("usable"):
        return False, f"namespaces not usable here: {res.get('reason', res)}"
    return True, ""


_OK, _WHY = _support()
needs_netns = pytest.mark.skipif(not _OK, reason=_WHY)


def _host_state() -> tuple[list[str], list[str], list[str]]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    names = sorted(line.split(":")[1].strip() for line in links.splitlines() if line.strip())
    etc = sorted(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else []
    return sorted(x.split()[0] for x in ns if x.strip()), names, etc


def _our_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [ln for ln in out.splitlines()
            if "experiments.cluster.delayer" in ln or "experiments.cluster.reaper" in ln]


@pytest.fixture
def host_unchanged():
    """Fails the test if a namespace, host interface, /etc/netns entry or helper process leaks."""
    before = _host_state()
    procs_before = _our_processes()
    yield
    after = _host_state()
    assert after == before, f"left behind: before={before} after={after}"
    deadline = time.monotonic() + 5
    while _our_processes() != procs_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _our_processes() == procs_before


ALLREDUCE = textwrap.dedent("""
    import datetime, os, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(r + 1))
    dist.all_reduce(t)
    print(f"RESULT rank={r} world={w} node_rank={os.environ['NODE_RANK']} "
          f"addr={os.environ['SSF_NODE_ADDR']} sum={t[0].item()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")

LIGHTNING = textwrap.dedent("""
    import os
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel
    n = int(os.environ["SSF_NUM_NODES"])
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", num_nodes=n, devices=1, max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(BoringModel())
    print(f"LIGHTNING_OK rank={trainer.global_rank} world={trainer.world_size} "
          f"step={trainer.global_step}", flush=True)
    # an orderly teardown: a rank that exits while its peer's gloo threads still run can abort
    # ("terminate called without an active exception", exit code 134)
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@needs_netns
def test_check_subcommand():
    p = subprocess.run([*CLI, "check", "--json"], capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["usable"] and res["netns"] and res["tbf"]


@needs_netns
def test_cli_runs_two_node_allreduce(tmp_path, host_unchanged):
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    logs = tmp_path / "logs"
    p = subprocess.run([*CLI, "run", "--nodes", "2", "--rate", "1gbit", "--delay", "0.5ms", "--timeout", "60",
                        "--log-dir", str(logs), "--", sys.executable, str(script)],
                       capture_output=True, text=True, cwd=REPO, env=_env(), timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "RESULT rank=0" in p.stdout  # rank 0 is streamed
    for rank in range(2):
        log = (logs / f"node{rank}.log").read_text()
        assert f"RESULT rank={rank} world=2 node_rank={rank} addr=10.231." in log, log
        assert "sum=3.0" in log, log


@needs_netns
def test_cli_timeout_kills_ranks_and_reports_max_exit_code(tmp_path, host_unchanged):
    p = subprocess.run([*CLI, "run", "-n", "2", "--timeout", "1", "--log-dir", str(tmp_path), "--",
                        "sh", "-c", 'echo "node $NODE_RANK"; sleep 60'],
                       capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    assert p.returncode == 124, p.stderr
    assert (tmp_path / "node1.log").read_text().strip() == "node 1"
    p = subprocess.run([*CLI, "run", "-n", "3", "-q", "--log-dir", str(tmp_path), "--",
                        "sh", "-c", "exit $NODE_RANK"], capture_output=True, text=True, cwd=REPO, env=_env(),
                       timeout=60)
    assert p.returncode == 2, p.stderr
    # fail-fast: rank 1 fails, rank 0 (stuck) is killed after --fail-grace; rc is the failing rank's
    t0 = time.monotonic()
    p = subprocess.run([*CLI, "run", "-n", "2", "-q", "--fail-grace", "0.5", "--log-dir", str(tmp_path), "--",
                        "sh", "-c", 'if [ "$NODE_RANK" = 1 ]; then exit 3; fi; sleep 60'],
                       capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
    assert p.returncode == 3, p.stderr
    assert time.monotonic() - t0 < 20


@needs_netns
def test_cli_sigterm_tears_down(tmp_path, host_unchanged):
    p = subprocess.Popen([*CLI, "run", "-n", "2", "--delay", "1ms", "--log-dir", str(tmp_path), "--",
                          "sh", "-c", "echo started; sleep 60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
    assert p.stdout.readline().strip() == "started"  # rank 0 streamed => cluster is up
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, err


@needs_netns
def test_api_shaping_and_lightning(tmp_path, host_unchanged):
    from experiments.cluster import EmulatedCluster
    from experiments.cluster.selftest import measure_tcp

    script = tmp_path / "lit.py"
    script.write_text(LIGHTNING)
    with EmulatedCluster(nodes=2, rate="200mbit") as c:
        # the configured rate caps throughput and set_rate changes it in place; how close a loaded
        # 2-core machine gets to the cap is a benchmark matter (selftest), so only a loose floor here
        for rate in (200e6, 50e6):
            c.set_rate(int(rate))
            m = measure_tcp(c, seconds=1.0, max_bytes=int(rate / 8 * 1.5))
            got = m.get("steady_mbit_s", m["mbit_s"]) * 1e6
            assert 0.25 * rate <= got <= 1.05 * rate, m
        # one-way delay on every received packet => RTT ~ 2 * delay
        c.set_delay("2ms")
        m = measure_tcp(c, seconds=0.3, max_bytes=1 << 20)
        assert 4.0 <= m["rtt_ms_median"] <= 6.0, m
        c.set_delay(None)

        res = c.run([sys.executable, str(script)], env=_env(), timeout=90, log_dir=tmp_path / "lit", stream=False)
        assert res.returncode == 0, res.log(0)[-3000:] + res.log(1)[-3000:]
        for rank in range(2):
            assert f"LIGHTNING_OK rank={rank} world=2 step=2" in res.log(rank), res.log(rank)[-3000:]


@needs_netns
def test_cleanup_removes_namespaces_of_dead_owners(host_unchanged):
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"ssfc{dead.pid}-dead-n0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        p = subprocess.run([*CLI, "cleanup"], capture_output=True, text=True, cwd=REPO, env=_env(), timeout=60)
        assert p.returncode == 0, p.stderr
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@needs_netns
def test_delay_fails_loudly_when_unavailable(monkeypatch, host_unchanged):
    from experiments.cluster import ClusterError, EmulatedCluster, Unsupported

    def broken(self):
        raise ClusterError("simulated: no TUN device")

    monkeypatch.setattr(EmulatedCluster, "_start_delayers", broken)
    with pytest.raises(Unsupported, match="--delay/--loss cannot be emulated"):
        with EmulatedCluster(nodes=2, rate="1gbit", delay="1ms"):
            pass


# ------------------------------------------------------------------ nodes of several ranks
def test_ranks_per_node_numbers_ranks_node_major_without_root():
    import ipaddress

    from experiments.cluster import EmulatedCluster

    c = EmulatedCluster(nodes=2, ranks_per_node=2)
    c.subnet = ipaddress.ip_network("10.231.7.0/24")  # what start() would choose; nothing is built
    envs = [c.env_for(rank) for rank in range(4)]
    assert [(e["RANK"], e["NODE_RANK"], e["LOCAL_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["LOCAL_WORLD_SIZE"] for e in envs} == {"2"} and {e["SSF_NUM_NODES"] for e in envs} == {"2"}
    # both ranks of a node have its address (and reach each other over its loopback)
    assert [e["SSF_NODE_ADDR"] for e in envs] == ["10.231.7.1", "10.231.7.1", "10.231.7.2", "10.231.7.2"]
    assert [c.log_name(rank) for rank in range(4)] == ["node0.0.log", "node0.1.log", "node1.0.log", "node1.1.log"]
    assert EmulatedCluster(nodes=3).log_name(2) == "node2.log"
    with pytest.raises(ValueError, match="rank 4"):
        c.node_of(4)
    with pytest.raises(ValueError, match="ranks_per_node"):
        EmulatedCluster(nodes=2, ranks_per_node=0)


NODE_LOCAL = textwrap.dedent("""
    import datetime, os, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    r, w = dist.get_rank(), dist.get_world_size()
    t = torch.full((10,), float(r + 1))
    dist.all_reduce(t)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    big = torch.ones(1 << 20)  # 4 MB: 4 s each way on the 8 Mbit/s link
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(big, group=groups[r // 2])
    print(f"RESULT rank={r} world={w} node={os.environ['NODE_RANK']} local={os.environ['LOCAL_RANK']} "
          f"sum={t[0].item()} local_seconds={time.perf_counter() - started:.3f} ok={bool((big == 2).all())}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
""")


@needs_netns
def test_two_ranks_per_node_talk_over_the_node_and_share_its_link(tmp_path, host_unchanged):
    from experiments.cluster import EmulatedCluster

    script = tmp_path / "node_local.py"
    script.write_text(NODE_LOCAL)
    with EmulatedCluster(nodes=2, ranks_per_node=2, rate="8mbit") as c:
        res = c.run([sys.executable, str(script)], env=_env(), timeout=90, log_dir=tmp_path / "logs", stream=False)
        logs = [res.log(rank) for rank in range(4)]
        assert res.returncode == 0, "\n".join(log[-1500:] for log in logs)
        assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
            "node0.0.log", "node0.1.log", "node1.0.log", "node1.1.log"]
        for rank, log in enumerate(logs):
            assert f"RESULT rank={rank} world=4 node={rank // 2} local={rank % 2} sum=10.0" in log, log[-1500:]
            assert "ok=True" in log
            # the node-local 4 MB all-reduce never touched the shaped link (it would take >= 4 s)
            seconds = float(log.split("local_seconds=")[1].split()[0])
            assert seconds < 2.0, log[-1500:]
        # every packet that left a node went through its one shaped NIC: the tbf on eth0 saw it,
        # and far less than the node-local 4 MB
        stats = subprocess.run(["tc", "-n", c.node_ns[0], "-s", "qdisc", "show", "dev", "eth0"],
                               capture_output=True, text=True).stdout
        sent = int(stats.split("Sent ")[1].split()[0])
        assert 0 < sent < 1 << 20, stats
