"""Tiny bounded TCP/UDP measurement tool used by ``selftest`` (runs inside node namespaces).

server: ``python -m experiments.cluster.netbench server --port P [--udp]`` prints one JSON line.
client: ``python -m experiments.cluster.netbench client --host H --port P --seconds S --max-bytes B``.

TCP protocol: the client first does ``--pings`` 1-byte ping-pongs (RTT), then streams data for
``--seconds`` (at most ``--max-bytes``) and closes. The client reports RTTs, the server reports
goodput measured on the receive side (overall and after a slow-start warm-up).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time

CHUNK = 1 << 20


def tcp_server(port: int, timeout: float, warmup: float) -> dict:
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("0.0.0.0", port))
    ls.listen(1)
    ls.settimeout(timeout)
    print("LISTENING", flush=True)
    conn, _ = ls.accept()
    conn.settimeout(timeout)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # ping-pong phase: echo single bytes until b"G" (go) arrives
    while True:
        b = conn.recv(1)
        if not b:
            return {"error": "closed during ping phase"}
        if b == b"G":
            break
        conn.sendall(b)
    total = 0
    t_first = t_last = None
    marks: list[tuple[float, int]] = []
    buf = bytearray(CHUNK)
    while True:
        n = conn.recv_into(buf)
        if n == 0:
            break
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        total += n
        marks.append((now, total))
    conn.close()
    ls.close()
    res = {"bytes": total}
    if t_first is not None and t_last > t_first:
        res["seconds"] = t_last - t_first
        res["mbit_s"] = total * 8 / (t_last - t_first) / 1e6
        # steady state: ignore the slow-start warm-up
        start = next(((t, b) for t, b in marks if t - t_first >= warmup), None)
        if start and t_last - start[0] > 0.2:
            res["steady_mbit_s"] = (total - start[1]) * 8 / (t_last - start[0]) / 1e6
    return res


def tcp_client(host: str, port: int, seconds: float, max_bytes: int, pings: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect((host, port))
            break
        except (ConnectionRefusedError, OSError):
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(pings):
        t = time.perf_counter()
        s.sendall(b"p")
        if s.recv(1) != b"p":
            raise RuntimeError("bad echo")
        rtts.append(time.perf_counter() - t)
    s.sendall(b"G")
    payload = b"\0" * CHUNK
    sent = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while sent < max_bytes and time.perf_counter() < end:
        s.sendall(payload)
        sent += len(payload)
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # wait for the server to close (all data delivered)
    s.close()
    res = {"sent": sent}
    if rtts:
        rtts = rtts[1:] or rtts  # first one includes ARP/cold caches
        res.update(rtt_ms_median=statistics.median(rtts) * 1e3, rtt_ms_min=min(rtts) * 1e3,
                   rtt_ms_max=max(rtts) * 1e3)
    return res


def udp_server(port: int, timeout: float, idle: float) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("0.0.0.0", port))
    print("LISTENING", flush=True)
    s.settimeout(timeout)
    seen = set()
    while True:
        try:
            data = s.recv(2048)
        except socket.timeout:
            break
        if data.startswith(b"END"):
            n = int(data[3:])
            return {"expected": n, "received": len(seen), "loss": 1 - len(seen) / n if n else 0.0}
        seen.add(int.from_bytes(data[:4], "big"))
        s.settimeout(idle)
    return {"error": "no END marker", "received": len(seen)}


def udp_client(host: str, port: int, count: int, pps: float) -> dict:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    gap = 1.0 / pps
    t = time.perf_counter()
    for i in range(count):
        s.sendto(i.to_bytes(4, "big") + b"\0" * 996, (host, port))
        t += gap
        d = t - time.perf_counter()
        if d > 0:
            time.sleep(d)
    time.sleep(0.2)
    for _ in range(5):
        s.sendto(b"END%d" % count, (host, port))
        time.sleep(0.01)
    return {"sent": count}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["server", "client"])
    ap.add_argument("--udp", action="store_true")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=5201)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--max-bytes", type=int, default=512 << 20)
    ap.add_argument("--pings", type=int, default=50)
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--pps", type=float, default=5000)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=0.3)
    a = ap.parse_args(argv)
    if a.mode == "server":
        res = udp_server(a.port, a.timeout, 2.0) if a.udp else tcp_server(a.port, a.timeout, a.warmup)
    else:
        res = (udp_client(a.host, a.port, a.count, a.pps) if a.udp
               else tcp_client(a.host, a.port, a.seconds, a.max_bytes, a.pings, a.timeout))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
