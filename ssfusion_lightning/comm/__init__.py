"""Collectives: channels over strategy-owned groups, sparse schemes, communicators, byte accounting."""

from __future__ import annotations

import importlib
import pkgutil

from ssfusion_lightning.comm.base import COMMUNICATORS, Communicator, PendingReduction, Reduced
from ssfusion_lightning.comm.channels import ChannelSet
from ssfusion_lightning.comm.schemes import SPARSE_SCHEMES, sparse_allreduce
from ssfusion_lightning.comm.traffic import Traffic

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")


def available_communicators() -> list[str]:
    return COMMUNICATORS.names()


__all__ = [
    "COMMUNICATORS",
    "SPARSE_SCHEMES",
    "ChannelSet",
    "Communicator",
    "PendingReduction",
    "Reduced",
    "Traffic",
    "available_communicators",
    "sparse_allreduce",
]
