"""Byte accounting for collectives: what one rank sent and received, with and without padding."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Traffic:
    """Bytes moved by this rank in one or more collectives.

    ``sent``/``received`` count the payload the scheme needs; ``padded_sent``/``padded_received``
    also count padding (e.g. allgather pads every rank to the largest count).
    """

    sent: int = 0
    received: int = 0
    padded_sent: int = 0
    padded_received: int = 0

    def add(self, sent: int, received: int, padded_sent: int | None = None, padded_received: int | None = None) -> None:
        self.sent += int(sent)
        self.received += int(received)
        self.padded_sent += int(sent if padded_sent is None else padded_sent)
        self.padded_received += int(received if padded_received is None else padded_received)

    def __iadd__(self, other: Traffic) -> Traffic:
        self.add(other.sent, other.received, other.padded_sent, other.padded_received)
        return self
