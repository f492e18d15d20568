"""Emulated multi-node cluster built from Linux network namespaces.

Topology (everything lives in namespaces created here; the host's interfaces are never touched)::

    netns <prefix>sw  : bridge "br0" with ports p0..p{N-1}            (the "switch")
    netns <prefix>n<i>: "eth0" = 10.231.X.(i+1)/24, veth peer of p<i>  (node i)

A node may host several ranks (``ranks_per_node``): they share the node's namespace and address,
so traffic between two ranks of one node never leaves the namespace (the kernel delivers a
packet to one of its own addresses over the namespace's loopback, unshaped), while every
packet to another node goes through the node's one shaped link (eth0), as on a real node with
a fast intra-node interconnect and one NIC.

Per node, each direction of its link is shaped with ``tbf`` to ``rate``: uplink on the
node's eth0 egress, downlink on the switch port p<i> egress (a full-duplex port).
Optional one-way ``delay`` and random ``loss`` are applied to every packet a node receives
by a user-space element (see :mod:`experiments.cluster.delayer`), because this kernel has
no ``netem``.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .units import format_rate, parse_fraction, parse_rate, parse_time

PREFIX = "ssfc"  # every namespace this module creates starts with this
NODE_IFNAME = "eth0"
DELAY_IFNAME = "ssfdly"
BRIDGE = "br0"
DEFAULT_MASTER_PORT = 29500
ETC_NETNS = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts over /etc/hosts
_NS_RE = re.compile(rf"^{PREFIX}(\d+)-([a-z0-9]+)-(sw|n\d+)$")


class ClusterError(RuntimeError):
    pass


class Unsupported(ClusterError):
    """Raised when a requested feature cannot be emulated on this kernel/host."""


def _ip_bin() -> str:
    path = shutil.which("ip") or "/usr/sbin/ip"
    return path


def _sh(args: Sequence[str], check: bool = True, input: str | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed ({proc.returncode}): {shlex.join(args)}\n{proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    proc = _sh([_ip_bin(), "netns", "list"], check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> list[int]:
    proc = _sh([_ip_bin(), "netns", "pids", ns], check=False)
    return [int(x) for x in proc.stdout.split() if x.isdigit()]


def _kill_ns_processes(ns: str, grace: float = 2.0) -> None:
    pids = _ns_pids(ns)
    if not pids:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids if _pid_alive(p)]
            # zombies of our own children count as alive for kill(0): reap them
            for p in list(pids):
                try:
                    if os.waitpid(p, os.WNOHANG)[0] == p:
                        pids.remove(p)
                except ChildProcessError:
                    pass
            if not pids:
                return
            time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    _kill_ns_processes(ns)
    _sh([_ip_bin(), "netns", "delete", ns], check=False)
    if ns.startswith(PREFIX):
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        try:
            ETC_NETNS.rmdir()  # only succeeds when empty, i.e. nobody else uses it
        except OSError:
            pass


def cleanup_leftovers(force: bool = False, verbose: bool = True) -> list[str]:
    """Delete namespaces named ``ssfc<pid>...`` whose creating process is gone
    (all of them with ``force=True``). Returns the deleted names."""
    removed = []
    for ns in list_namespaces():
        m = _NS_RE.match(ns)
        if not m:
            continue
        owner = int(m.group(1))
        if not force and _pid_alive(owner):
            if verbose:
                print(f"skipping {ns}: owner pid {owner} still running (use --force)", file=sys.stderr)
            continue
        delete_namespace(ns)
        removed.append(ns)
        if verbose:
            print(f"removed {ns}", file=sys.stderr)
    return removed


def _host_networks() -> list[ipaddress.IPv4Network]:
    nets = []
    for args in (["-4", "-o", "addr", "show"], ["-4", "route", "show", "table", "all"]):
        out = _sh([_ip_bin(), *args], check=False).stdout
        for tok in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", out):
            try:
                nets.append(ipaddress.ip_network(tok, strict=False))
            except ValueError:
                pass
    return [n for n in nets if n.prefixlen > 0]


def choose_subnet(preferred: str | None = None) -> ipaddress.IPv4Network:
    """A private /24 in 10.231.0.0/16 that overlaps nothing configured on the host."""
    used = _host_networks()
    candidates = [ipaddress.ip_network(preferred)] if preferred else (
        ipaddress.ip_network(f"10.231.{x}.0/24") for x in range(256))
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise ClusterError(f"no free subnet (tried {preferred or '10.231.0.0/16'})")


def probe_support(verbose: bool = False) -> dict:
    """Create a throw-away namespace and try each building block. Never raises."""
    res: dict = {"root": os.geteuid() == 0}
    name = f"{PREFIX}{os.getpid()}-probe-n0"
    if not res["root"]:
        res["netns"] = False
        res["reason"] = "not running as root (namespaces, veth and tc need CAP_NET_ADMIN + CAP_SYS_ADMIN)"
        return res
    if shutil.which("ip") is None or shutil.which("tc") is None:
        res["netns"] = False
        res["reason"] = "iproute2 ('ip' and 'tc') not installed"
        return res
    ip = _ip_bin()
    try:
        p = _sh([ip, "netns", "add", name], check=False)
        res["netns"] = p.returncode == 0
        if not res["netns"]:
            res["reason"] = f"'ip netns add' failed: {p.stderr.strip()}"
            return res
        res["veth"] = _sh([ip, "-n", name, "link", "add", "a0", "type", "veth", "peer", "name", "a1"],
                          check=False).returncode == 0
        _sh([ip, "-n", name, "link", "set", "a0", "up"], check=False)
        res["bridge"] = _sh([ip, "-n", name, "link", "add", "b0", "type", "bridge"], check=False).returncode == 0
        res["tbf"] = _sh(["tc", "-n", name, "qdisc", "add", "dev", "a0", "root", "tbf", "rate", "1gbit",
                          "burst", "128kb", "latency", "50ms"], check=False).returncode == 0
        p = _sh(["tc", "-n", name, "qdisc", "add", "dev", "a1", "root", "netem", "delay", "1ms"], check=False)
        res["netem"] = p.returncode == 0
        res["clsact_mirred"] = (
            _sh(["tc", "-n", name, "qdisc", "add", "dev", "a1", "clsact"], check=False).returncode == 0
            and _sh(["tc", "-n", name, "filter", "add", "dev", "a1", "ingress", "protocol", "ip", "u32",
                     "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", "a0"],
                    check=False).returncode == 0)
        res["tun"] = os.path.exists("/dev/net/tun")
        if res["tun"]:
            p = _sh([ip, "netns", "exec", name, sys.executable, "-c",
                     "import sys; from experiments.cluster.delayer import open_tun; open_tun('t0', True)"],
                    check=False)
            res["tun"] = p.returncode == 0
            if p.returncode != 0 and verbose:
                print(p.stderr, file=sys.stderr)
    finally:
        delete_namespace(name)
    res["delay"] = bool(res.get("netem") or (res.get("tun") and res.get("clsact_mirred")))
    res["loss"] = res["delay"]
    res["usable"] = all(res.get(k) for k in ("netns", "veth", "bridge", "tbf"))
    if not res["usable"] and "reason" not in res:
        missing = [k for k in ("veth", "bridge", "tbf") if not res.get(k)]
        res["reason"] = f"missing kernel features: {', '.join(missing)}"
    return res


@dataclasses.dataclass
class RunResult:
    returncode: int            # max over ranks; 124 on timeout
    returncodes: list[int | None]
    timed_out: bool
    elapsed: float
    log_dir: Path
    logs: list[Path]

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")


def default_log_dir() -> Path:
    """A fresh directory under $TMPDIR/ssf_cluster_logs (never inside the repository)."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}"
    return Path(tempfile.gettempdir()) / "ssf_cluster_logs" / stamp


def _norm_rc(rc: int | None) -> int:
    if rc is None:
        return 124
    return 128 - rc if rc < 0 else rc


class EmulatedCluster:
    """N emulated nodes on one host.

    >>> with EmulatedCluster(nodes=4, rate="1gbit", delay="0.5ms") as c:   # doctest: +SKIP
    ...     res = c.run(["python", "train.py"], timeout=600)
    ...     c.set_rate("100mbit")
    ...     res = c.run(["python", "train.py"], timeout=600)
    """

    def __init__(self, nodes: int, rate: str | int | None = "1gbit", delay: str | float | None = None,
                 loss: str | float | None = None, *, subnet: str | None = None, mtu: int = 1500,
                 queue: str | float = "50ms", master_port: int = DEFAULT_MASTER_PORT,
                 verbose: bool = False, ranks_per_node: int = 1) -> None:
        if nodes < 1:
            raise ValueError("nodes must be >= 1")
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be an integer >= 1, got {ranks_per_node!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.rate_bps = parse_rate(rate) if rate not in (None, "", "none", 0) else None
        self.delay_s = parse_time(delay) if delay not in (None, "") else 0.0
        self.loss = parse_fraction(loss) if loss not in (None, "") else 0.0
        self.mtu = mtu
        self.queue_s = parse_time(queue)
        self.master_port = master_port
        self.verbose = verbose
        self.token = f"{os.getpid()}-{secrets.token_hex(2)}"
        self._subnet_pref = subnet
        self.subnet: ipaddress.IPv4Network | None = None
        self.switch_ns = f"{PREFIX}{self.token}-sw"
        self.node_ns = [f"{PREFIX}{self.token}-n{i}" for i in range(nodes)]
        self.iface = NODE_IFNAME
        self._created: list[str] = []
        self._delayers: list[subprocess.Popen | None] = [None] * nodes
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._closed = False
        self._started = False
        self._reaper: subprocess.Popen | None = None

    # ------------------------------------------------------------------ setup
    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[cluster] {msg}", file=sys.stderr, flush=True)

    def addr(self, node: int) -> str:
        """Node ``node``'s address (every rank of the node has it)."""
        assert self.subnet is not None
        return str(self.subnet.network_address + node + 1)

    def node_of(self, rank: int) -> int:
        """The node of global rank ``rank`` (ranks are numbered node-major, as Lightning does)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1}")
        return rank // self.ranks_per_node

    def log_name(self, rank: int) -> str:
        """``node<i>.log`` with one rank per node, ``node<i>.<local rank>.log`` otherwise."""
        node = self.node_of(rank)
        return f"node{node}.log" if self.ranks_per_node == 1 else f"node{node}.{rank % self.ranks_per_node}.log"

    @property
    def master_addr(self) -> str:
        return self.addr(0)

    def _ip(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh([_ip_bin(), "-n", ns, *args], check=check)

    def _tc(self, ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _sh(["tc", "-n", ns, *args], check=check)

    def _sysctl(self, ns: str, settings: Mapping[str, str]) -> None:
        script = "; ".join(f"echo {v} > /proc/sys/{k.replace('.', '/')}" for k, v in settings.items())
        _sh([_ip_bin(), "netns", "exec", ns, "sh", "-c", script])

    def start(self) -> "EmulatedCluster":
        if self._started:
            return self
        if os.geteuid() != 0:
            raise Unsupported("EmulatedCluster needs root (network namespaces, veth, tc)")
        self._started = True
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        self.subnet = choose_subnet(self._subnet_pref)
        if self.nodes > self.subnet.num_addresses - 2:
            raise ClusterError(f"{self.nodes} nodes do not fit in {self.subnet}")
        ip = _ip_bin()
        t0 = time.monotonic()
        self._start_reaper()
        for ns in [self.switch_ns, *self.node_ns]:
            _sh([ip, "netns", "add", ns])
            self._created.append(ns)
            self._sysctl(ns, {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"})
        sw = self.switch_ns
        self._ip(sw, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        self._ip(sw, "link", "set", "lo", "up")
        for i, ns in enumerate(self.node_ns):
            port = f"p{i}"
            # both ends are created directly inside their namespaces: nothing ever appears in the host's
            self._ip(sw, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                     "peer", "name", self.iface, "netns", ns, "mtu", str(self.mtu))
            self._ip(sw, "link", "set", port, "master", BRIDGE, "up")
            self._ip(ns, "link", "set", "lo", "up")
            self._ip(ns, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", self.iface)
            self._ip(ns, "link", "set", self.iface, "up")
            self._sysctl(ns, {"net.ipv4.conf.all.rp_filter": "0", "net.ipv4.conf.default.rp_filter": "0",
                              f"net.ipv4.conf.{self.iface}.rp_filter": "0"})
        self._ip(sw, "link", "set", BRIDGE, "up")
        self._write_hosts()
        self._apply_rate()
        self._apply_delay_loss()
        self._wait_reachable()
        self._log(f"cluster up in {time.monotonic() - t0:.2f}s: {self.describe()}")

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                         env.get("PYTHONPATH")]))
        return env

    def _start_reaper(self) -> None:
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "experiments.cluster.reaper", "--owner", str(os.getpid()),
             "--namespaces", self.switch_ns, *self.node_ns],
            stdin=subprocess.DEVNULL, start_new_session=True, env=self._child_env())

    def _write_hosts(self) -> None:
        """Per-node /etc/hosts: ``ssf-node<i>`` names for every node, and the host's hostname
        mapped to the node's own address (so hostname-based address discovery sees the node)."""
        hostname = socket.gethostname()
        names = "".join(f"{self.addr(j)}\tssf-node{j}\n" for j in range(self.nodes))
        for i, ns in enumerate(self.node_ns):
            d = ETC_NETNS / ns
            d.mkdir(parents=True, exist_ok=True)
            (d / "hosts").write_text(f"127.0.0.1\tlocalhost\n{self.addr(i)}\t{hostname}\n{names}")

    def describe(self) -> str:
        rate = format_rate(self.rate_bps) if self.rate_bps else "unlimited"
        ranks = f" x {self.ranks_per_node} ranks" if self.ranks_per_node > 1 else ""
        return (f"{self.nodes} nodes{ranks} in {self.subnet} (ns {self.node_ns[0]}..), rate {rate}, "
                f"delay {self.delay_s * 1e3:g}ms, loss {self.loss * 100:g}%")

    def _tbf_args(self) -> list[str]:
        assert self.rate_bps
        bytes_per_s = self.rate_bps / 8
        # burst must hold a full 64 KiB GSO packet, else tbf re-segments everything to MTU size
        burst = int(max(bytes_per_s * 0.001, 128 * 1024))
        limit = int(max(bytes_per_s * self.queue_s, 2 * burst))
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(burst), "limit", str(limit)]

    def _apply_rate(self) -> None:
        for i, ns in enumerate(self.node_ns):
            for where, dev in ((ns, self.iface), (self.switch_ns, f"p{i}")):
                if self.rate_bps:
                    self._tc(where, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *self._tbf_args())
                else:
                    self._tc(where, "qdisc", "del", "dev", dev, "root", check=False)

    def _stop_delayer(self, i: int) -> None:
        p = self._delayers[i]
        self._delayers[i] = None
        self._tc(self.node_ns[i], "qdisc", "del", "dev", self.iface, "clsact", check=False)
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _apply_delay_loss(self) -> None:
        for i in range(self.nodes):
            self._stop_delayer(i)
        if not self.delay_s and not self.loss:
            return
        try:
            self._start_delayers()
        except ClusterError as e:
            for i in range(self.nodes):
                self._stop_delayer(i)
            raise Unsupported(
                "--delay/--loss cannot be emulated on this host: the kernel has no netem qdisc and the "
                f"TUN + tc clsact/mirred fallback failed ({e}). Run without --delay/--loss.") from e

    def _start_delayers(self) -> None:
        for i, ns in enumerate(self.node_ns):
            env = self._child_env()
            p = subprocess.Popen(
                [_ip_bin(), "netns", "exec", ns, sys.executable, "-u", "-m", "experiments.cluster.delayer",
                 "--ifname", DELAY_IFNAME, "--delay", repr(self.delay_s), "--loss", repr(self.loss)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True, env=env)
            self._delayers[i] = p
            ready, _, _ = select.select([p.stdout], [], [], 20.0)
            line = p.stdout.readline() if ready else ""
            if not line.startswith("READY"):
                if p.poll() is None:
                    p.kill()
                err = p.stdout.read() if p.poll() is not None else ""
                raise ClusterError(f"delay/loss element failed to start in {ns}: {line.strip()} {err.strip()}")
            self._ip(ns, "link", "set", DELAY_IFNAME, "up", "txqueuelen", "10000", "mtu", str(self.mtu))
            self._sysctl(ns, {f"net.ipv4.conf.{DELAY_IFNAME}.rp_filter": "0"})
            self._tc(ns, "qdisc", "add", "dev", self.iface, "clsact")
            # IPv4 only: ARP keeps flowing directly so neighbour resolution is not delayed twice
            self._tc(ns, "filter", "add", "dev", self.iface, "ingress", "protocol", "ip", "pref", "10",
                     "u32", "match", "u32", "0", "0",
                     "action", "mirred", "egress", "redirect", "dev", DELAY_IFNAME)

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until every node's address is reachable from node 0 (ARP + delay path)."""
        script = (
            "import socket,sys,time\n"
            "deadline=time.monotonic()+float(sys.argv[1])\n"
            "for a in sys.argv[2:]:\n"
            "  while True:\n"
            "    s=socket.socket(socket.AF_INET,socket.SOCK_STREAM); s.settimeout(1)\n"
            "    try:\n"
            "      s.connect((a,9)); break\n"
            "    except ConnectionRefusedError: break\n"
            "    except OSError:\n"
            "      if time.monotonic()>deadline: sys.exit('unreachable '+a)\n"
            "      time.sleep(0.05)\n"
            "    finally: s.close()\n")
        targets = [self.addr(i) for i in range(1, self.nodes)]
        if not targets:
            return
        _sh([_ip_bin(), "netns", "exec", self.node_ns[0], sys.executable, "-c", script, str(timeout), *targets],
            timeout=timeout + 10)

    # -------------------------------------------------------------- changes
    def set_rate(self, rate: str | int | None) -> None:
        """Change every link's rate (both directions) in place; ``None`` removes shaping."""
        self.rate_bps = parse_rate(rate) if rate not in (None, "", "none", 0) else None
        self._apply_rate()

    def set_delay(self, delay: str | float | None) -> None:
        self.delay_s = parse_time(delay) if delay not in (None, "") else 0.0
        self._apply_delay_loss()
        self._wait_reachable()

    def set_loss(self, loss: str | float | None) -> None:
        self.loss = parse_fraction(loss) if loss not in (None, "") else 0.0
        self._apply_delay_loss()
        self._wait_reachable()

    # ------------------------------------------------------------------ run
    def env_for(self, rank: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment of global rank ``rank`` (node ``rank // ranks_per_node``): ``os.environ`` +
        ``extra`` + the cluster's variables (which win).

        Variables that would make Lightning/torch detect a *different* cluster (SLURM, torchelastic,
        MPI, LSF, Kubernetes) are removed."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_ENV_PREFIXES)}
        if extra:
            env.update({k: str(v) for k, v in extra.items()})
        node = self.node_of(rank)
        env.update({
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NODE_RANK": str(node),
            "RANK": str(rank),           # node-major: node * ranks_per_node + local rank
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank % self.ranks_per_node),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            # gloo binds to the node's address; a peer of the same node is reached over loopback
            "GLOO_SOCKET_IFNAME": self.iface,
            "TP_SOCKET_IFNAME": self.iface,
            "NCCL_SOCKET_IFNAME": self.iface,
            "SSF_NUM_NODES": str(self.nodes),
            "SSF_RANKS_PER_NODE": str(self.ranks_per_node),
            "SSF_NODE_ADDR": self.addr(node),
        })
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.world_size)))
        env.pop("GROUP_RANK", None)
        return env

    def popen(self, rank: int, cmd: Sequence[str], env: Mapping[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start ``cmd`` inside the namespace of global rank ``rank``'s node (its own process group;
        with one rank per node, node ``rank``). The caller owns the process; it is still killed
        by :meth:`close`."""
        if not self._started or self._closed:
            raise ClusterError("cluster is not running")
        kw.setdefault("start_new_session", True)
        p = subprocess.Popen([_ip_bin(), "netns", "exec", self.node_ns[self.node_of(rank)], *cmd],
                             env=dict(env) if env is not None else self.env_for(rank), **kw)
        with self._lock:
            self._procs.append(p)
        return p

    def run(self, cmd: Sequence[str] | str, env: Mapping[str, str] | None = None, timeout: float | None = None,
            log_dir: str | os.PathLike | None = None, stream: bool = True,
            rank_env: Callable[[int], Mapping[str, str]] | None = None, fail_grace: float = 30.0,
            stream_to=None) -> RunResult:
        """Run ``cmd`` once per rank (``ranks_per_node`` copies in every node; same command,
        per-rank env) and wait for all of them.

        ``env``: extra variables for every rank (the cluster's MASTER_ADDR/NODE_RANK/... still win);
        ``rank_env(i)``: per-rank variables applied last (may override anything).
        Rank ``i``'s stdout+stderr go to ``log_dir/``:meth:`log_name` (``node<i>.log`` with
        one rank per node); rank 0's are also streamed to
        ``stream_to`` (default ``sys.stdout``). On ``timeout`` every rank is killed and
        ``returncode`` is 124. If a rank fails, the others are killed after ``fail_grace`` s and
        ``returncode`` is the largest code among the ranks that exited by themselves.
        """
        if isinstance(cmd, str):
            cmd = ["sh", "-c", cmd]
        if log_dir is None:
            log_dir = default_log_dir()
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        out = stream_to if stream_to is not None else sys.stdout
        procs: list[subprocess.Popen] = []
        files = []
        threads = []
        logs = [log_dir / self.log_name(i) for i in range(self.world_size)]
        t0 = time.monotonic()
        timed_out = False
        natural: list[int | None] = [None] * self.world_size
        try:
            for i in range(self.world_size):
                e = self.env_for(i, env)
                if rank_env:
                    e.update({k: str(v) for k, v in rank_env(i).items()})
                f = open(logs[i], "wb")
                files.append(f)
                if i == 0 and stream:
                    p = self.popen(i, cmd, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
                    th = threading.Thread(target=_tee, args=(p.stdout, f, out), daemon=True)
                    th.start()
                    threads.append(th)
                else:
                    p = self.popen(i, cmd, env=e, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
                procs.append(p)
            deadline = t0 + timeout if timeout else None
            first_fail: float | None = None
            while True:
                codes = natural = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if first_fail is None and any(c not in (None, 0) for c in codes):
                    first_fail = now
                if deadline is not None and now >= deadline:
                    timed_out = True
                    self._log(f"timeout after {timeout}s: killing all ranks")
                    break
                if first_fail is not None and now - first_fail > fail_grace:
                    self._log("a rank failed: killing the remaining ranks")
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                _kill_group(p)
            for th in threads:
                th.join(5)
            for f in files:
                f.close()
            with self._lock:
                self._procs = [p for p in self._procs if p not in procs]
        codes = [p.returncode for p in procs]
        exited = [_norm_rc(c) for c in natural if c is not None]
        rc = 124 if timed_out else max(exited or [_norm_rc(c) for c in codes])
        return RunResult(rc, codes, timed_out, time.monotonic() - t0, log_dir, logs)

    # ------------------------------------------------------------- teardown
    def close(self) -> None:
        """Kill everything started in the cluster and delete all namespaces. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        old = _block_signals()
        try:
            for p in procs:
                _kill_group(p)
            for i in range(self.nodes):
                try:
                    self._stop_delayer(i)
                except Exception:
                    pass
            for ns in reversed(self._created):
                delete_namespace(ns)  # takes the veths / bridge / tun with it
            leftovers = [ns for ns in list_namespaces() if ns in self._created]
            if leftovers:
                print(f"[cluster] WARNING: could not delete namespaces {leftovers}", file=sys.stderr)
            self._created = []
            if self._reaper is not None and self._reaper.poll() is None:
                self._reaper.terminate()
                try:
                    self._reaper.wait(5)
                except subprocess.TimeoutExpired:
                    self._reaper.kill()
                    self._reaper.wait()
        finally:
            _restore_signals(old)
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def __enter__(self) -> "EmulatedCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _tee(src, f, out) -> None:
    buf = getattr(out, "buffer", None)
    for line in iter(src.readline, b""):
        f.write(line)
        f.flush()
        try:
            if buf is not None:
                buf.write(line)
                buf.flush()
            else:
                out.write(line.decode(errors="replace"))
                out.flush()
        except (ValueError, OSError):
            pass
    src.close()


def _kill_group(p: subprocess.Popen, grace: float = 3.0) -> None:
    if p.poll() is not None:
        # the leader exited; its group may still have members (e.g. dataloader workers)
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_FOREIGN_ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "LSB_", "KUBERNETES_")
_SIGS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _block_signals():
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, _SIGS)


def _restore_signals(old) -> None:
    if old is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
