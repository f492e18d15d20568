"""Watchdog that deletes a cluster's namespaces if the process that owns it dies abruptly
(SIGKILL, OOM, crash), so no namespace/veth/rank process outlives its owner.

Started by :class:`EmulatedCluster` in its own session; stopped by it on a normal close.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--owner", type=int, required=True)
    ap.add_argument("--namespaces", nargs="+", required=True)
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # owner closed the cluster itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)            # Ctrl-C is the owner's business
    try:
        fd = os.pidfd_open(a.owner)
        select.select([fd], [], [])
    except (AttributeError, OSError):
        while True:
            try:
                os.kill(a.owner, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
    from .core import delete_namespace, list_namespaces

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # finish the job once started
    existing = set(list_namespaces())
    for ns in a.namespaces:
        if ns in existing:
            delete_namespace(ns)
            print(f"[cluster-reaper] owner {a.owner} died; removed {ns}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
