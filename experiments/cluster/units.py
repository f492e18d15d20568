"""Parsing of tc-style rate / time / percentage strings."""

from __future__ import annotations

import re

# tc conventions: "bit" suffixes are bits per second, "bps" suffixes are BYTES per second.
_RATE_UNITS = {
    "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9, "tbps": 8 * 10**12,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, "ns": 1e-9}
_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_rate(value: str | int | float) -> int:
    """Return a rate in bits per second. Accepts tc syntax ("1gbit", "100mbit", "12.5mbps")
    or a plain number (bits per second)."""
    if isinstance(value, (int, float)):
        bits = float(value)
    else:
        m = re.fullmatch(_NUM + r"\s*([a-zA-Z]*)", value.strip())
        if not m:
            raise ValueError(f"cannot parse rate {value!r} (examples: 1gbit, 100mbit, 500kbit)")
        unit = m.group(2).lower() or "bit"
        if unit not in _RATE_UNITS:
            raise ValueError(f"unknown rate unit {m.group(2)!r} in {value!r}; use one of {sorted(_RATE_UNITS)}")
        bits = float(m.group(1)) * _RATE_UNITS[unit]
    if bits < 8000:
        raise ValueError(f"rate {value!r} is too small (minimum 8kbit)")
    return int(bits)


def parse_time(value: str | int | float) -> float:
    """Return a duration in seconds. Accepts "0.5ms", "200us", "1s" or a number of seconds."""
    if isinstance(value, (int, float)):
        t = float(value)
    else:
        m = re.fullmatch(_NUM + r"\s*([a-zA-Z]*)", value.strip())
        if not m:
            raise ValueError(f"cannot parse time {value!r} (examples: 0.5ms, 200us, 1s)")
        unit = m.group(2).lower() or "s"
        if unit not in _TIME_UNITS:
            raise ValueError(f"unknown time unit {m.group(2)!r} in {value!r}; use one of {sorted(_TIME_UNITS)}")
        t = float(m.group(1)) * _TIME_UNITS[unit]
    if t < 0:
        raise ValueError(f"negative time {value!r}")
    return t


def parse_fraction(value: str | int | float) -> float:
    """Return a probability in [0, 1]. "0.1%" -> 0.001; a bare number is a fraction (0.001)."""
    if isinstance(value, (int, float)):
        p = float(value)
    else:
        s = value.strip()
        if s.endswith("%"):
            p = float(s[:-1]) / 100.0
        else:
            p = float(s)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"probability {value!r} outside [0, 1]")
    return p


def format_rate(bits: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.4g}{unit}"
    return f"{bits:.0f}bit"
