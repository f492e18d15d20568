"""User-space one-way delay / loss element for one emulated node.

This kernel has no ``netem`` qdisc (nor ``fq``/``etf``, so EDT pacing from BPF is not
possible either).  Delay is therefore implemented like this, per node namespace::

    peer --> [switch] --> eth0 (ingress) --tc u32 + mirred--> ssfdly (TUN) --> this process
                                                                                   |
                                     node IP stack <-- ssfdly (rx) <-- write() after `delay`

Every IPv4 packet *received* by the node is redirected by a ``tc`` ingress filter to the
egress of a TUN device owned by this process.  The process time-stamps each packet,
holds it in a FIFO for ``delay`` seconds and writes it back into the TUN device, from
where the kernel delivers it to the node's stack (rp_filter is disabled by the cluster).
With ``IFF_VNET_HDR`` + TSO offload enabled on the TUN, TCP segments stay aggregated
(up to 64 KiB per packet), so the per-packet Python cost is paid ~2k times per second
at 1 Gbit/s rather than ~80k times.

Loss: each packet is dropped with probability ``loss``.  When loss is requested the TUN
is opened *without* segmentation offload, so the kernel segments TCP super-packets to
MTU size before handing them over and loss applies per wire packet (at a higher CPU cost).

If this process dies, the TUN device disappears and the mirred action drops traffic:
the emulation fails closed (jobs stall and hit their timeout) instead of silently
running without delay.

Run (inside the node namespace)::

    python -m experiments.cluster.delayer --ifname ssfdly --delay 0.0005 --loss 0
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04
TUN_F_TSO_ECN = 0x08
PR_SET_PDEATHSIG = 1
PR_SET_TIMERSLACK = 29
READ_SIZE = 256 * 1024
MAX_BATCH = 512


def open_tun(ifname: str, offload: bool) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    ifr = struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
    fcntl.ioctl(fd, TUNSETIFF, ifr)
    flags = (TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) if offload else 0
    fcntl.ioctl(fd, TUNSETOFFLOAD, flags)
    return fd


def _prctl(option: int, arg: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    except Exception:  # pragma: no cover - best effort
        pass


def serve(fd: int, delay_s: float, loss: float, stats_every: float = 0.0) -> None:
    delay_ns = int(round(delay_s * 1e9))
    queue: collections.deque[tuple[int, bytes]] = collections.deque()
    rng = random.Random()
    rx = tx = dropped = write_err = 0
    # Timer wake-ups arrive late by tens to hundreds of microseconds (VM, Python).  Learn that
    # lateness (EWMA) and go to sleep that much earlier; release packets due within TOL_NS.
    early_ns = 50_000
    TOL_NS = 20_000
    last_stats = time.monotonic()
    mono = time.monotonic_ns
    read, write = os.read, os.write
    while True:
        now = mono()
        while queue and queue[0][0] <= now + TOL_NS:
            _, pkt = queue.popleft()
            try:
                write(fd, pkt)
                tx += 1
            except OSError as e:  # e.g. malformed packet / no buffer: drop, like a real link
                if e.errno not in (errno.EAGAIN, errno.EINVAL, errno.ENOBUFS, errno.EIO):
                    raise
                write_err += 1
        if queue:
            target = queue[0][0] - early_ns
            timeout_ns = target - mono()
            if timeout_ns <= 0:
                r, _, _ = select.select([fd], [], [], 0)
                if not r:
                    # cannot sleep less than the wake-up latency: spin briefly on the queue head
                    continue
            else:
                r, _, _ = select.select([fd], [], [], timeout_ns / 1e9)
                if not r:
                    late = mono() - target
                    early_ns = min(max(int(0.9 * early_ns + 0.1 * late), 0), 500_000)
                    continue
        else:
            r, _, _ = select.select([fd], [], [], 1.0)
            if not r:
                continue
        now = mono()
        due = now + delay_ns
        for _ in range(MAX_BATCH):
            try:
                pkt = read(fd, READ_SIZE)
            except BlockingIOError:
                break
            rx += 1
            if loss and rng.random() < loss:
                dropped += 1
                continue
            if delay_ns == 0:
                try:
                    write(fd, pkt)
                    tx += 1
                except OSError:
                    write_err += 1
            else:
                queue.append((due, pkt))
        if stats_every and time.monotonic() - last_stats > stats_every:
            last_stats = time.monotonic()
            print(f"rx={rx} tx={tx} dropped={dropped} write_err={write_err} queued={len(queue)} "
                  f"early_us={early_ns / 1e3:.0f}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ifname", default="ssfdly")
    ap.add_argument("--delay", type=float, default=0.0, help="one-way delay in seconds")
    ap.add_argument("--loss", type=float, default=0.0, help="drop probability per packet")
    ap.add_argument("--stats-every", type=float, default=0.0)
    args = ap.parse_args(argv)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    _prctl(PR_SET_TIMERSLACK, 1)  # ns-granularity wakeups for sub-ms delays
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))  # keep latency low under load
    except (OSError, AttributeError):
        pass
    fd = open_tun(args.ifname, offload=(args.loss == 0.0))
    print(f"READY {args.ifname}", flush=True)
    try:
        serve(fd, args.delay, args.loss, args.stats_every)
    except KeyboardInterrupt:
        pass
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
