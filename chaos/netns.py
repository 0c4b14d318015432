"""Real hosts on one machine: network namespaces joined to this one by veth pairs on a bridge,
each a Ray worker node, and the faults between them that a real network has.

``Hosts(n)`` makes a switch: a namespace ``vsn<id>sw`` holding a bridge, joined to this (the
root) namespace by a veth pair whose root side ``vsv<id>r`` holds ``10.217.<x>.1/24`` (where this
machine's Ray head listens); and ``n`` hosts, namespaces ``vsn<id>h<i>``, each joined to the
switch by a veth pair (``h<i>`` on the bridge, ``eth0`` inside with ``10.217.<x>.<10+i>``). A Ray
worker node started inside (``start_node``) is another host as far as Ray, gloo and ZMQ can
tell: its own address, its own loopback, its own routes (not its own ``/dev/shm``: see
``start_node``). The bridge lives in the switch's own
namespace, so the root namespace's firewall (bridge netfilter) never sees the hosts' traffic,
and the traffic never leaves these namespaces.

The verbs, each what an operator's network does to a host:

* ``partition(i)``: the host's link goes down: it is alive, its processes go on running, and no
  packet passes either way (TCP connections stall, they are not reset); ``heal(i)``: up again;
* ``partition(i, side="head")``: the head's side loses the host instead: a blackhole route in
  this namespace, so nothing from here (the Ray head, the daemon) reaches it, while what it sends
  still arrives and is never answered (one-way at the IP level: TCP stalls both ways);
* ``slow(i, rate)``: a rate limit (``tc qdisc … tbf``; this kernel has no ``netem``) on both
  directions of its link; ``unslow(i)``;
* ``kill_node(i)``: every process of the host, SIGKILL (a power cut);
* ``start_node(i)`` again after a kill: its Ray node back (a node supervisor restarting it).

``close()`` removes everything it made, even after a failure: the processes in each namespace,
the namespaces (their veth pairs go with them) and the bridge; ``leftovers()`` says what is
still there. The suite runs as root (CI does); ``available()`` says whether this host can.

``python -m chaos.netns --hosts 2`` makes them, prints the addresses and waits for Ctrl-C.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from executor import procfs
from executor.cluster import answers
from executor.engine import kill_pids
from executor.reaper import descendants


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def available() -> str:
    """"" when this host can make namespaces; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} (iproute2) is not installed"
    return ""


@dataclass
class Host:
    index: int
    ns: str
    veth: str  # its port on the switch's bridge
    address: str
    node_pids: list[int] = field(default_factory=list)
    partitioned: str = ""  # "", "host" (its link down) or "head" (this namespace's route to it gone)
    healed_monotonic: float = 0.0  # when its last partition ended
    slowed: str = ""


class Hosts:
    def __init__(self, n: int, subnet: int | None = None):
        self.id = secrets.token_hex(2)
        third = subnet if subnet is not None else 100 + int(self.id, 16) % 100
        self.prefix = f"10.217.{third}"
        self.switch = f"vsn{self.id}sw"
        self.uplink = f"vsv{self.id}r"  # the root side of the link to the switch
        self.bridge_address = f"{self.prefix}.1"  # on the uplink: the root namespace's address
        self.hosts = [Host(i, f"vsn{self.id}h{i}", f"h{i}", f"{self.prefix}.{10 + i}") for i in range(n)]
        self.head_address = ""  # host:port of the Ray head on the bridge, once ``start_head`` ran
        self._head_dir: Path | None = None
        self._head_marks: list[bytes] = []  # its temporary directory and address, in its processes' command lines
        self._head_procs: set[tuple[int, int]] = set()  # (pid, start time) of its processes seen so far
        self._env: dict[str, str] = {}
        self._made: list[str] = []  # namespaces to remove

    # --- making and removing --------------------------------------------------------

    def __enter__(self) -> "Hosts":
        return self.make()

    def __exit__(self, *exc) -> None:
        self.close()

    def make(self) -> "Hosts":
        sw = self.switch
        self._clear_stale()
        try:
            _ip("ip", "netns", "add", sw)
            self._made.append(sw)
            _ip("ip", "link", "add", "br0", "type", "bridge", ns=sw)
            _ip("ip", "link", "set", "br0", "up", ns=sw)
            _ip("ip", "link", "set", "lo", "up", ns=sw)
            _ip("ip", "link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", sw)
            _ip("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.uplink)
            _ip("ip", "link", "set", self.uplink, "up")
            _ip("ip", "link", "set", "up0", "master", "br0", ns=sw)
            _ip("ip", "link", "set", "up0", "up", ns=sw)
            for h in self.hosts:
                _ip("ip", "netns", "add", h.ns)
                self._made.insert(0, h.ns)
                _ip("ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.ns, ns=sw)
                _ip("ip", "link", "set", h.veth, "master", "br0", ns=sw)
                _ip("ip", "link", "set", h.veth, "up", ns=sw)
                _ip("ip", "addr", "add", f"{h.address}/24", "dev", "eth0", ns=h.ns)
                _ip("ip", "link", "set", "eth0", "up", ns=h.ns)
                _ip("ip", "link", "set", "lo", "up", ns=h.ns)
                _ip("ip", "route", "add", "default", "via", self.bridge_address, ns=h.ns)
                self._name_files(h)
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _clear_stale() -> None:
        """What an earlier run killed half-way (a CI timeout's SIGKILL) left: blackhole routes in
        10.217.0.0/16 and ``/etc/netns/vsn*`` folders whose namespace is gone."""
        for line in _ip("ip", "route", "show", "type", "blackhole", check=False).stdout.splitlines():
            if (target := line.split()[1] if len(line.split()) > 1 else "").startswith("10.217."):
                _ip("ip", "route", "del", "blackhole", target, check=False)
        namespaces = set(_ip("ip", "netns", "list", check=False).stdout.split())
        for folder in Path("/etc/netns").glob("vsn*"):
            if folder.name not in namespaces:
                shutil.rmtree(folder, ignore_errors=True)

    def _name_files(self, h: Host) -> None:
        """``/etc/netns/<ns>/{hosts,resolv.conf}``, which ``ip netns exec`` mounts over the host's:
        every host's name in ``hosts``, and a resolver on the namespace's own loopback, which
        refuses at once. Without them a lookup there waits for a DNS server it cannot reach
        (c10d's reverse lookup of a peer, 10 s at each TP group's start)."""
        folder = Path("/etc/netns") / h.ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("127.0.0.1 localhost\n" + f"{self.bridge_address} head\n"
                                      + "".join(f"{o.address} {o.ns}\n" for o in self.hosts))
        (folder / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def close(self) -> None:
        """Everything it made goes, whatever state it is in (called twice: the second does nothing)."""
        for h in self.hosts:
            self._kill_ns(h)
            _ip("ip", "route", "del", "blackhole", f"{h.address}/32", check=False)  # whatever it was told since
        if self._head_dir is not None:  # this head's processes only (``ray stop`` would end every cluster here)
            for _ in range(50):
                if not kill_pids(self._head_pids()):
                    break
                time.sleep(0.2)
        for name in self._made:
            _ip("ip", "netns", "del", name, check=False)
        self._made = []
        for h in self.hosts:
            shutil.rmtree(Path("/etc/netns") / h.ns, ignore_errors=True)
        # A namespace's veth pairs go when the kernel frees it, a moment later (asynchronously);
        # the uplink still there is removed by name.
        deadline = time.monotonic() + 10
        while self.leftovers() and time.monotonic() < deadline:
            _ip("ip", "link", "del", self.uplink, check=False)
            time.sleep(0.2)
        for h in self.hosts:
            shutil.rmtree(f"/tmp/vsr{self.id}h{h.index}", ignore_errors=True)
        if self._head_dir is not None:
            shutil.rmtree(self._head_dir, ignore_errors=True)
            self._head_dir = None

    def _head_pids(self) -> list[int]:
        """The live processes of the Ray head this fixture started: those whose command lines
        name its temporary directory or its address (its GCS, raylet, client server, the
        Python processes beside them), their descendants (the agents, which rename
        themselves), and every one seen so (``_remember_head``) that still runs."""
        if not self._head_marks:
            return []
        table = procfs.process_table()
        marked = [pid for pid in table if pid != os.getpid()
                  and any(m in (procfs.read(pid, "cmdline") or b"") for m in self._head_marks)]
        tree = {pid for pid, _ in self._head_procs if table.get(pid, (0, None))[1] == _}
        for pid in marked:
            tree |= {pid} | {child for child, _ in descendants(pid, table)}
        return sorted(p for p in tree if procfs.running(p))

    def _remember_head(self) -> None:
        table = procfs.process_table()
        self._head_procs |= {(pid, table[pid][1]) for pid in self._head_pids() if pid in table}

    def leftovers(self) -> list[str]:
        """Namespaces, links, routes and Ray head processes of this fixture that still exist."""
        namespaces = _ip("ip", "netns", "list", check=False).stdout.split()
        out = [ns for ns in [self.switch, *(h.ns for h in self.hosts)] if ns in namespaces]
        links = _ip("ip", "-o", "link", "show", check=False).stdout
        routes = _ip("ip", "route", "show", "type", "blackhole", check=False).stdout.split()
        return (out + ([self.uplink] if f" {self.uplink}@" in links or f" {self.uplink}:" in links else [])
                + [f"blackhole {h.address}" for h in self.hosts if h.address in routes]
                + [f"ray head pid {pid}" for pid in self._head_pids()]
                + [str(Path("/etc/netns") / h.ns) for h in self.hosts if (Path("/etc/netns") / h.ns).exists()])

    def _kill_ns(self, h: Host) -> list[int]:
        """SIGKILL every process in ``h``'s namespace (a host's power cut)."""
        killed = []
        for _ in range(20):
            out = _ip("ip", "netns", "pids", h.ns, check=False).stdout.split()
            pids = [int(p) for p in out if p.isdigit()]
            if not pids:
                break
            killed += kill_pids(pids)
            time.sleep(0.2)
        h.node_pids = []
        return sorted(set(killed))

    # --- Ray: the head on the bridge, a worker node per host ---------------------------------

    def _head_env(self) -> dict[str, str]:
        return {**os.environ, **self._env}

    def start_head(self, env: dict[str, str], port: int) -> str:
        """A Ray head in this namespace, listening on the bridge's address (no CPUs: the
        workers go to the hosts). Returns its address."""
        self._env = dict(env)
        self._head_dir = Path(f"/tmp/vsr{self.id}")  # short: Ray's socket paths are limited in length
        self._head_dir.mkdir(parents=True, exist_ok=True)
        self._head_marks = [str(self._head_dir).encode(), f"={self.bridge_address}:{port}".encode()]
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--node-ip-address={self.bridge_address}",
             f"--port={port}", "--num-cpus=0", "--include-dashboard=false", "--disable-usage-stats",
             f"--temp-dir={self._head_dir}"],
            check=True, capture_output=True, env=self._head_env(), timeout=180)
        self.head_address = f"{self.bridge_address}:{port}"
        self._remember_head()
        return self.head_address

    def start_node(self, i: int, num_cpus: int = 1) -> None:
        """Host ``i``'s Ray worker node, joined to the head over its link."""
        h = self.hosts[i]
        temp = Path(f"/tmp/vsr{self.id}h{i}")
        temp.mkdir(parents=True, exist_ok=True)
        # The hosts share this machine's /dev/shm: vLLM's CPU backend runs a TP group through
        # shared memory only (``cpu_communicator``: ranks that agree on a group name open one
        # segment), so TP ranks on two hosts with a /dev/shm each cannot start. On GPU hosts
        # NCCL crosses the link. The network faults here reach everything else: Ray's control
        # plane, the engine core's channels to each worker, the daemon's calls.
        subprocess.run(
            ["ip", "netns", "exec", h.ns,
             sys.executable, "-m", "ray.scripts.scripts", "start",
             f"--address={self.head_address}", f"--node-ip-address={h.address}", f"--num-cpus={num_cpus}",
             f"--object-store-memory={256 * 2**20}", "--disable-usage-stats", f"--temp-dir={temp}"],
            check=True, capture_output=True, text=True, timeout=180,
            # gloo (vLLM's CPU collectives) binds where the hostname resolves unless told: the
            # container's address, which a host namespace does not have. An operator of a
            # multi-homed CPU node sets the same.
            env={**self._head_env(), "GLOO_SOCKET_IFNAME": "eth0"})
        h.node_pids = [int(p) for p in _ip("ip", "netns", "pids", h.ns).stdout.split() if p.isdigit()]
        self._remember_head()  # the head's agents are up by now

    # --- the faults -----------------------------------------------------------------

    def partition(self, i: int, side: str = "host") -> None:
        """Host ``i`` unreachable, alive. ``side="host"``: its link down (no packet passes either
        way). ``side="head"``: this namespace's route to it is a blackhole (nothing from the
        head and the daemon reaches it; what it sends arrives and is never answered)."""
        h = self.hosts[i]
        if side == "host":
            _ip("ip", "link", "set", h.veth, "down", ns=self.switch)
        elif side == "head":
            _ip("ip", "route", "add", "blackhole", f"{h.address}/32")
        else:
            raise ValueError(f"side must be 'host' or 'head', not {side!r}")
        h.partitioned = side

    def heal(self, i: int) -> None:
        h = self.hosts[i]
        if h.partitioned == "head":
            _ip("ip", "route", "del", "blackhole", f"{h.address}/32", check=False)
        else:
            _ip("ip", "link", "set", h.veth, "up", ns=self.switch)
        h.partitioned = ""
        h.healed_monotonic = time.monotonic()

    def slow(self, i: int, rate: str = "1mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """A rate limit on both directions of host ``i``'s link (a token bucket: ``tc … tbf``)."""
        h = self.hosts[i]
        for dev, ns in ((h.veth, self.switch), ("eth0", h.ns)):
            _ip("tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency, ns=ns)
        h.slowed = rate

    def unslow(self, i: int) -> None:
        h = self.hosts[i]
        for dev, ns in ((h.veth, self.switch), ("eth0", h.ns)):
            _ip("tc", "qdisc", "del", "dev", dev, "root", ns=ns, check=False)
        h.slowed = ""

    def kill_node(self, i: int) -> list[int]:
        return self._kill_ns(self.hosts[i])

    def pids(self, i: int) -> list[int]:
        """Every process in host ``i``'s namespace now."""
        return [int(p) for p in _ip("ip", "netns", "pids", self.hosts[i].ns, check=False).stdout.split() if p.isdigit()]

    def reachable(self, i: int, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from this namespace to host ``i``'s ``port`` gets an answer
        (accepted or refused) within ``timeout_s`` (the daemon's own test: ``executor.cluster.answers``)."""
        return answers(self.hosts[i].address, port, timeout_s)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    args = parser.parse_args(argv)
    if why := available():
        print(why, file=sys.stderr)
        return 1
    with Hosts(args.hosts) as hosts:
        print(f"switch {hosts.switch}, this namespace at {hosts.bridge_address}; hosts: " + ", ".join(f"{h.ns} {h.address}" for h in hosts.hosts))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
