"""Emulated multi-node cluster (network namespaces + veth + bridge + tc) on one machine.

See README.md in this directory. Entry points::

    python -m experiments.cluster run --nodes 4 --rate 1gbit -- python train.py
    python -m experiments.cluster selftest | check | cleanup

    from experiments.cluster import EmulatedCluster
"""

from .core import (
    ClusterError,
    EmulatedCluster,
    RunResult,
    Unsupported,
    cleanup_leftovers,
    list_namespaces,
    probe_support,
)
from .units import parse_fraction, parse_rate, parse_time

__all__ = [
    "ClusterError", "EmulatedCluster", "RunResult", "Unsupported", "cleanup_leftovers",
    "list_namespaces", "probe_support", "parse_fraction", "parse_rate", "parse_time",
]
