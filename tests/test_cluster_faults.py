"""A link that goes down mid-training on the emulated cluster: the survivor fails, naming the step."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from tests.test_cluster import needs_netns

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "link_cut_job.py")


@needs_netns
def test_a_cut_link_fails_the_step_instead_of_hanging(tmp_path):
    from experiments.cluster import EmulatedCluster

    root = os.path.dirname(os.path.dirname(JOB))
    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
        env = [cluster.env_for(i, {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}) for i in range(2)]
        jobs = [cluster.popen(i, [sys.executable, JOB], env=env[i], stdout=logs[i], stderr=logs[i]) for i in range(2)]
        deadline = time.monotonic() + 120
        while "STEP 5\n" not in (tmp_path / "node0.log").read_text():
            assert jobs[0].poll() is None, (tmp_path / "node0.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.5)
        cut = time.monotonic()
        cluster._ip(cluster.node_ns[1], "link", "set", cluster.iface, "down")
        try:
            returncode = jobs[0].wait(timeout=120)
        except Exception:
            pytest.fail("rank 0 still hangs 120 s after its peer's link went down")
        waited = time.monotonic() - cut
        for job in jobs:
            if job.poll() is None:
                job.kill()
        output = (tmp_path / "node0.log").read_text()
    assert returncode != 0
    assert "CommunicationError: ssfusion: step" in output, output[-3000:]
    # whichever collective was in flight when the link went: a buffer's exchange or the round's vote
    assert re.search(r"step \d+: (buffer \d+ \(hybrid on process group \d+\)|non-finite check) failed", output), output[-3000:]
    assert waited < 90, f"failed only after {waited:.0f}s (timeout is 15 s)"
