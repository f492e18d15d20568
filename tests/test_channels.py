"""A channel's thread after a failure: the groups a job may still be blocked in are reported, so
that teardown does not destroy a process group under a running collective."""

from __future__ import annotations

import threading

import torch

from ssfusion_lightning.comm import ChannelSet


def test_shutdown_without_wait_reports_the_groups_a_job_is_still_running_on():
    # stand-ins for process groups: a channel only hands its group to the jobs
    channels = ChannelSet(["group0", "group1"], torch.device("cpu"))
    started, release = threading.Event(), threading.Event()

    def blocked(group):
        started.set()
        release.wait(10)
        return group

    running = channels[1].submit(blocked)
    queued = channels[1].submit(lambda group: group)
    assert channels[0].submit(lambda group: group).result(timeout=10).value == "group0"
    assert started.wait(10)
    assert channels.shutdown(wait=False) == ["group1"]
    assert queued.cancelled()  # nothing new starts on a stopped channel
    release.set()
    assert running.result(timeout=10).value == "group1"
    assert not channels[1].busy and channels.shutdown(wait=True) == []
