"""CLI: python -m experiments.cluster {run,check,cleanup,selftest} ...

    python -m experiments.cluster run --nodes 4 --rate 1gbit --delay 0.5ms [--loss 0.1%] \\
        [--log-dir DIR] [--timeout S] -- python train.py --num-nodes 4
    python -m experiments.cluster check        # are namespaces / tc / delay usable here?
    python -m experiments.cluster cleanup      # delete leftover ssfc* namespaces of dead runs
    python -m experiments.cluster selftest     # measure throughput / RTT / loss vs configuration
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from .core import ClusterError, EmulatedCluster, Unsupported, cleanup_leftovers, default_log_dir, probe_support


class Terminated(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _install_signal_handlers() -> None:
    def handler(signum, _frame):
        # raise once; the cluster blocks these signals while it tears down
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, handler)


def _none(v: str | None) -> str | None:
    return None if v is None or v.lower() in ("", "none", "0", "off") else v


def cmd_run(a: argparse.Namespace) -> int:
    cmd = a.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("error: no command given (usage: run --nodes N [options] -- CMD ...)", file=sys.stderr)
        return 2
    log_dir = a.log_dir or default_log_dir()
    cluster = EmulatedCluster(nodes=a.nodes, rate=_none(a.rate), delay=_none(a.delay), loss=_none(a.loss),
                              subnet=a.subnet, mtu=a.mtu, queue=a.queue, master_port=a.master_port,
                              verbose=not a.quiet, ranks_per_node=a.ranks_per_node)
    try:
        with cluster:
            res = cluster.run(cmd, timeout=a.timeout, log_dir=log_dir, stream=not a.no_stream,
                              fail_grace=a.fail_grace)
    except Terminated as t:
        print(f"[cluster] {t}: ranks killed, namespaces removed", file=sys.stderr)
        return 128 + t.signum
    if not a.quiet:
        codes = ",".join("timeout" if c is None else str(c) for c in res.returncodes)
        print(f"[cluster] done in {res.elapsed:.1f}s: exit codes [{codes}]"
              f"{' (TIMEOUT)' if res.timed_out else ''}; logs in {res.log_dir}", file=sys.stderr)
    return res.returncode


def cmd_check(a: argparse.Namespace) -> int:
    res = probe_support(verbose=a.verbose)
    if a.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:14s} {v}")
        if not res.get("netem"):
            print("note: no netem qdisc; --delay/--loss use the TUN user-space element "
                  + ("(available)" if res.get("delay") else "(NOT available here)"))
    return 0 if res.get("usable") else 1


def cmd_cleanup(a: argparse.Namespace) -> int:
    removed = cleanup_leftovers(force=a.force, verbose=True)
    print(f"removed {len(removed)} namespace(s)")
    return 0


def cmd_selftest(a: argparse.Namespace) -> int:
    from .selftest import run_selftest

    ok, results = run_selftest(rates=[r for r in a.rates.split(",") if r], delay=_none(a.delay),
                               loss=_none(a.loss), seconds=a.seconds, verbose=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"ok": ok, "results": results}, f, indent=2)
    print("selftest " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.cluster", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="sub", required=True)

    r = sub.add_parser("run", help="run a command once per emulated node")
    r.add_argument("--nodes", "-n", type=int, required=True)
    r.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks in every node: they share its namespace (a fast unshaped local path) and its link")
    r.add_argument("--rate", default="1gbit", help="per-node link rate, each direction (tc syntax; 'none' = unshaped)")
    r.add_argument("--delay", default=None, help="one-way delay added to every packet a node receives (e.g. 0.5ms)")
    r.add_argument("--loss", default=None, help="random loss per packet received (e.g. 0.1%%)")
    r.add_argument("--log-dir", default=None,
                   help="per-rank logs node<i>.log, node<i>.<local rank>.log with several ranks per node (default $TMPDIR/ssf_cluster_logs/<time>)")
    r.add_argument("--timeout", type=float, default=None, help="kill all ranks after this many seconds (exit 124)")
    r.add_argument("--fail-grace", type=float, default=30.0, help="kill the other ranks this long after one fails")
    r.add_argument("--master-port", type=int, default=29500)
    r.add_argument("--subnet", default=None, help="IPv4 /24 for the nodes (default: first free 10.231.X.0/24)")
    r.add_argument("--mtu", type=int, default=1500)
    r.add_argument("--queue", default="50ms", help="tbf queue length expressed as time at the link rate")
    r.add_argument("--no-stream", action="store_true", help="do not stream rank 0's output")
    r.add_argument("--quiet", "-q", action="store_true")
    r.add_argument("command", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run)

    c = sub.add_parser("check", help="report whether namespaces/veth/tbf/delay work here")
    c.add_argument("--json", action="store_true")
    c.add_argument("--verbose", "-v", action="store_true")
    c.set_defaults(fn=cmd_check)

    cl = sub.add_parser("cleanup", help="remove leftover ssfc* namespaces")
    cl.add_argument("--force", action="store_true", help="also remove namespaces whose owner is still running")
    cl.set_defaults(fn=cmd_cleanup)

    s = sub.add_parser("selftest", help="measure that rate/delay/loss shaping works")
    s.add_argument("--rates", default="1gbit,100mbit")
    s.add_argument("--delay", default="1ms")
    s.add_argument("--loss", default="2%")
    s.add_argument("--seconds", type=float, default=2.0)
    s.add_argument("--json", default=None, help="also write results to this file")
    s.set_defaults(fn=cmd_selftest)

    a = ap.parse_args(argv)
    _install_signal_handlers()
    try:
        return a.fn(a)
    except Terminated as t:
        print(f"[cluster] interrupted by {t}; cleaned up", file=sys.stderr)
        return 128 + t.signum
    except Unsupported as e:
        print(f"[cluster] not supported here: {e}", file=sys.stderr)
        return 3
    except ClusterError as e:
        print(f"[cluster] error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
