"""Check that the emulation does what it claims: throughput ~ rate, RTT ~ 2*delay, loss ~ p."""

from __future__ import annotations

import json
import subprocess
import sys

from .core import EmulatedCluster
from .units import format_rate, parse_fraction, parse_rate, parse_time

_BENCH = [sys.executable, "-u", "-m", "experiments.cluster.netbench"]


def _start_server(c: EmulatedCluster, rank: int, args: list[str]) -> subprocess.Popen:
    p = c.popen(rank, [*_BENCH, "server", *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("LISTENING"):
        raise RuntimeError(f"netbench server failed: {line}{p.stderr.read()}")
    return p


def _finish(p: subprocess.Popen, timeout: float) -> dict:
    out, err = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"netbench failed ({p.returncode}): {out}{err}")
    return json.loads(lines[-1])


def measure_tcp(c: EmulatedCluster, src: int = 0, dst: int = 1, seconds: float = 2.0,
                max_bytes: int = 256 << 20, port: int = 5201) -> dict:
    """Bulk TCP from node ``src`` to ``dst``: bounded by ``seconds`` and ``max_bytes``."""
    srv = _start_server(c, dst, ["--port", str(port), "--timeout", str(seconds + 20)])
    cli = c.popen(src, [*_BENCH, "client", "--host", c.addr(dst), "--port", str(port), "--seconds",
                        str(seconds), "--max-bytes", str(max_bytes), "--timeout", str(seconds + 20)],
                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        cres = _finish(cli, seconds + 30)
        sres = _finish(srv, 30)
    finally:
        for p in (cli, srv):
            if p.poll() is None:
                p.kill()
                p.wait()
    return {**cres, **sres}


def measure_udp_loss(c: EmulatedCluster, src: int = 0, dst: int = 1, count: int = 4000, pps: float = 4000,
                     port: int = 5202) -> dict:
    srv = _start_server(c, dst, ["--udp", "--port", str(port), "--timeout", "20"])
    cli = c.popen(src, [*_BENCH, "client", "--udp", "--host", c.addr(dst), "--port", str(port),
                        "--count", str(count), "--pps", str(pps)],
                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _finish(cli, count / pps + 30)
        return _finish(srv, 30)
    finally:
        for p in (cli, srv):
            if p.poll() is None:
                p.kill()
                p.wait()


def run_selftest(rates=("1gbit", "100mbit"), delay="1ms", loss="2%", seconds: float = 2.0,
                 verbose: bool = True, rate_tolerance: float = 0.15) -> tuple[bool, list[dict]]:
    """Returns (all_ok, results). Each result has 'check', 'expected', 'measured', 'ok'."""
    results: list[dict] = []

    def report(r: dict) -> None:
        results.append(r)
        if verbose:
            print(("PASS " if r["ok"] else "FAIL ") + json.dumps(r), flush=True)

    rate_list = [parse_rate(r) for r in rates]
    with EmulatedCluster(nodes=2, rate=rate_list[0], verbose=verbose) as c:
        base_rtt = None
        for rate in rate_list:
            c.set_rate(rate)
            # TCP goodput on a shaped link is ~95% of the wire rate (headers count against it);
            # measure twice at most: a busy shared CPU can depress one sample
            for _attempt in range(2):
                m = measure_tcp(c, seconds=seconds, max_bytes=int(rate / 8 * seconds * 1.5))
                got = m.get("steady_mbit_s", m.get("mbit_s", 0.0)) * 1e6
                ok = (1 - rate_tolerance) * rate <= got <= 1.03 * rate
                if ok:
                    break
            base_rtt = m.get("rtt_ms_median", base_rtt)
            report({"check": "tcp_throughput", "rate": format_rate(rate), "expected_mbit_s": rate / 1e6,
                    "measured_mbit_s": round(got / 1e6, 1), "ratio": round(got / rate, 3),
                    "rtt_ms_median": round(m.get("rtt_ms_median", float("nan")), 3), "ok": ok})
        if delay:
            d = parse_time(delay)
            c.set_delay(d)
            m = measure_tcp(c, seconds=seconds, max_bytes=int(rate_list[-1] / 8 * seconds * 1.5))
            rtt = m["rtt_ms_median"] / 1e3
            expected = 2 * d
            # allow the un-delayed base RTT plus up to 1 ms of user-space scheduling overhead
            ok = expected <= rtt <= expected + (base_rtt or 0) / 1e3 + 1e-3
            report({"check": "rtt_with_delay", "delay_ms": d * 1e3, "expected_rtt_ms": expected * 1e3,
                    "base_rtt_ms": round(base_rtt or 0, 3), "measured_rtt_ms_median": round(rtt * 1e3, 3),
                    "measured_rtt_ms_min": round(m["rtt_ms_min"], 3), "ok": ok})
            got = m.get("steady_mbit_s", m.get("mbit_s", 0.0)) * 1e6
            ok = (1 - rate_tolerance) * rate_list[-1] <= got <= 1.03 * rate_list[-1]
            report({"check": "tcp_throughput_with_delay", "rate": format_rate(rate_list[-1]),
                    "delay_ms": d * 1e3, "measured_mbit_s": round(got / 1e6, 1),
                    "ratio": round(got / rate_list[-1], 3), "ok": ok})
            c.set_delay(None)
        if loss:
            p = parse_fraction(loss)
            c.set_loss(p)
            n = 5000
            m = measure_udp_loss(c, count=n)
            # each datagram is dropped once (at the receiver); 4-sigma binomial band
            sigma = (p * (1 - p) / n) ** 0.5
            ok = abs(m.get("loss", -1) - p) <= 4 * sigma + 1e-3
            report({"check": "udp_loss", "expected": p, "measured": round(m.get("loss", -1), 4),
                    "received": m.get("received"), "sent": n, "ok": ok})
            c.set_loss(None)
    return all(r["ok"] for r in results), results
