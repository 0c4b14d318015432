"""Run the real daemon as a user would (``vllm-supervisor serve --supervisor-config FILE …``) and check
what it leaves behind. Shared by the integration and chaos tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from chaos.leaks import Leaks

BIN = Path(sys.executable).parent
SHM = Path("/dev/shm")
MARKER_ENV = "VLLM_SUPERVISOR_TEST_MARKER"

# The environment of the user who started the run, as it was then. Every daemon starts from it
# (plus what its test names), never from what the test process later put in its own environment
# (the operator's token below, say): a daemon on its private cluster gets what a user's shell
# has, nothing more.
USER_ENV = dict(os.environ)
# The clusters the tests start themselves (``ray start --head``, ``ray.cluster_utils``) stand for
# an operator's cluster: token auth with the operator's token, which the operator exports, with
# the mode, in the shell that runs the daemon (``systemd/vllm-supervisor.env``) or an injector.
OPERATOR_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


def as_operator() -> None:
    """This process joins the operator's clusters (to start one, or to inject a fault): the
    operator's token in its own environment, before Ray is imported (Ray reads the mode then).
    Daemons never inherit it (they start from ``USER_ENV``)."""
    os.environ.update(OPERATOR_ENV)
    if "ray" in sys.modules:  # imported already: refresh its cached config, as ray.init() does on enabling token mode
        from ray._raylet import Config

        Config.initialize("")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(str(value))


def write_toml(path: Path, config: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for section, values in config.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def shm_segments() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith(("psm_", "sem.mp-", "sem.hdr", "sem.obj")) or "cpushm" in p.name}


def stale_actors(names: list[str], status: dict) -> list[str]:
    """Actor names that belong neither to the serving generation nor to the warm standby the
    daemon prepares for the next one (``status["standby"]``)."""
    own = [f"-g{r['generation']}" for r in status.get("replicas") or ()] or [f"-g{status['generation']}"]
    standby = status.get("standby") or {}
    if standby.get("state") in ("preparing", "ready", "adopting"):
        own.append(f"-g{standby['for_generation']}")
    return [n for n in names if not any(n.endswith(t) or f"{t}_" in n for t in own)]


def marked_pids(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (the daemon's descendants)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    from executor import procfs

    return [pid for pid in procfs.pids()
            if needle in (procfs.read(pid, "environ") or b"").split(b"\0") and procfs.running(pid)]


class Daemon:
    """One daemon subprocess, its config, its log and its leftovers."""

    live_markers: set[str] = set()  # of the daemons this process started and that still run

    def __init__(self, workdir: Path, config: dict[str, dict[str, Any]], env: dict[str, str] | None = None,
                 shared_data_dir: bool = True, args: tuple[str, ...] = (), port: int | None = None,
                 own_session: bool = False):
        self.workdir = workdir
        # In a session of its own, as a service or a command typed in its own shell runs: the
        # kernel's autogroup scheduling then weighs its processes apart from whoever started it
        # (a benchmark client: ``bench.common``), as it does a ``vllm serve`` started so.
        self.own_session = own_session
        self.args = list(args)  # more `vllm-supervisor serve` flags (vLLM's or ours)
        self.port = port or free_port()  # a port again: the daemon that follows a crashed one
        self.marker = uuid.uuid4().hex
        config = {k: dict(v) for k, v in config.items()}
        config.setdefault("server", {}).update(port=self.port, host="127.0.0.1")
        if shared_data_dir:  # else the daemon's own default (under its HOME) applies
            config.setdefault("supervisor", {}).setdefault("data_dir", str(data_dir()))
        if not config.get("ray", {}).get("address") and any((env or {}).get(k) is not None for k in RAY_AUTH_VARS):
            # a test must not hand a daemon on its private cluster what a user's shell lacks
            raise ValueError(f"a daemon on its private Ray cluster starts with the user's Ray auth settings, not {env}")
        self.config_path = write_toml(workdir / "daemon.toml", config)
        self.log_path = workdir / "daemon.log"
        inherited = {k: v for k, v in USER_ENV.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        merged = dict(inherited, **(env or {}), **{MARKER_ENV: self.marker})
        self.env = {k: v for k, v in merged.items() if v is not None}  # None: unset it
        # where the daemon keeps its demo model and run record: as configured, else its default
        # under the HOME it was given
        from config.settings import SupervisorSettings

        default = SupervisorSettings.model_fields["data_dir"].default
        configured = config.get("supervisor", {}).get("data_dir")
        self.data_dir = Path(configured) if configured else Path(self.env.get("HOME", "~")) / default.relative_to("~")
        self.proc: subprocess.Popen | None = None
        self.shm_before: set[str] = set()
        self.seen: set[tuple[int, int]] = set()  # (pid, start time) of every descendant seen
        self.base_url = f"http://127.0.0.1:{self.port}"

    def start(self) -> "Daemon":
        self.shm_before = shm_segments()
        self.leaks = Leaks()  # the whole /dev/shm listing and every process, before the daemon
        Daemon.live_markers.add(self.marker)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(BIN / "vllm-supervisor"), "serve", "--supervisor-config", str(self.config_path), *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
            start_new_session=self.own_session,
        )
        return self

    def remember(self) -> set[tuple[int, int]]:
        """Record the daemon's live descendants. The marker in the environment does not find
        them all: ``setproctitle`` (Ray's agents, vLLM's engine core) overwrites it."""
        from executor.reaper import descendants

        if self.proc is not None and self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
        return self.seen

    def leftover_pids(self) -> list[int]:
        """Descendants seen earlier or marked, still running (same pid and start time)."""
        from executor.reaper import process_table

        table = process_table()
        alive = {pid for pid, st in self.seen if table.get(pid, (0, None))[1] == st}
        alive |= set(marked_pids(self.marker))
        return sorted(alive - ({self.proc.pid} if self.proc is not None and self.proc.poll() is None else set()))

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=kw.pop("timeout", 30), **kw)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.base_url + path, timeout=kw.pop("timeout", 120), **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=kw.pop("timeout", 120), **kw)

    def wait_ready(self, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode} before ready:\n{self.tail()}")
            try:
                r = self.get("/readyz", timeout=2)
                if r.status_code == 200:
                    self.remember()
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"daemon not ready within {timeout_s} s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 90, group: bool = False) -> tuple[int, float]:
        """Send ``sig``; return (exit code, seconds to exit). ``group``: to the daemon's whole
        process group, as a shell's job control (``kill %1``, Ctrl-C), ``timeout`` or
        ``kill -- -PGID`` do: every process in it (Ray's and vLLM's too) gets it at once. Only
        for a daemon in a session of its own (``own_session``), whose group is its alone."""
        started = time.monotonic()
        if self.proc.poll() is None:
            self.remember()
            if group:
                assert self.own_session, "a daemon in the test's own process group: the signal would reach the test"
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"daemon did not exit within {timeout_s} s of {sig}:\n{self.tail()}")
        return code, time.monotonic() - started

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        """Whatever happened, no daemon outlives its test."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        Daemon.live_markers.discard(self.marker)

    def status(self) -> dict:
        """``/readyz?verbose`` (200 or 503, always JSON)."""
        return self.get("/readyz?verbose").json()

    def full_status(self) -> dict:
        """``ctl status --json`` over the control socket: the status plus the serving
        generation's workers (rank, actor name, pid, node) from Ray."""
        from supervisor.control import request, socket_path

        return request(socket_path(port=self.port), "status", timeout_s=30)["status"]

    def unmapped_segments(self) -> set[str]:
        """``/dev/shm`` segments that appeared since this daemon started and no live process
        maps: what a torn-down generation left behind (multiprocessing's ``sem.mp-*`` aside)."""
        from executor.shm import mapped_segments

        return {n for n in (shm_segments() - self.shm_before) - mapped_segments() if not n.startswith("sem.mp-")}

    def dead_sockets(self, settle_s: float = 15) -> list[str]:
        """Sockets that appeared since this daemon started, one level down in the temporary
        directory (its runtime directory, where vLLM's ZeroMQ endpoints are), and that no live
        process has bound: what a torn-down generation left behind. The daemon sweeps them
        once the old engine is released (2 s after its teardown) and its workers have exited:
        polled for up to ``settle_s``, empty when clean."""
        deadline = time.monotonic() + settle_s
        while (left := self.leaks.dead_sockets()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def wait_replicas_serving(self, above: dict[int, int] | None = None, timeout_s: float = 300) -> list[dict]:
        """Until every engine replica serves, each on a generation above ``above[replica]``
        when given; returns the replicas' status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reps = self.status()["replicas"]
            if all(r["state"] == "serving" and r["generation"] > (above or {}).get(r["replica"], 0) for r in reps):
                return reps
            time.sleep(0.2)
        raise AssertionError(f"replicas not all serving within {timeout_s} s: {self.status()}\n{self.tail()}")

    def wait_standby(self, state: str = "ready", timeout_s: float = 180, **more: Any) -> dict:
        """Wait until the warm standby is in ``state`` (and its status has ``more``); returns
        the daemon's status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            sb = s["standby"]
            if sb["state"] == state and all(sb.get(k) == v for k, v in more.items()):
                self.remember()
                return s
            time.sleep(0.3)
        raise AssertionError(f"standby not {state} {more} within {timeout_s} s: {self.status()['standby']}\n{self.tail()}")

    def wait_generation(self, generation: int, timeout_s: float = 300) -> dict:
        """Wait until READY on at least ``generation``; returns the status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            s = self.status()
            if s["state"] == "ready" and s["generation"] >= generation:
                self.remember()
                return s
            if s["state"] in ("failed", "stopped"):
                break
            time.sleep(0.2)
        raise AssertionError(f"generation {generation} not ready within {timeout_s} s: {self.status()}\n{self.tail()}")

    def kill(self) -> None:
        """Last-resort clean-up for a failed test: kill the daemon and all its descendants,
        then remove the shared memory they created (a SIGKILLed daemon cannot)."""
        from executor.shm import sweep

        self.remember()
        for pid in [self.proc.pid, *self.leftover_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while self.leftover_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        # Its Ray workers are the raylet's children, not its own: Ray stops them once it sees
        # the driver gone, and they map their rings until they exit.
        deadline = time.monotonic() + 30
        while True:
            left = self.new_segments()
            left -= set(sweep(left))
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if left:
            print(f"harness: {self.marker}'s rings still mapped 30 s after its kill: {sorted(left)}", file=sys.stderr)
        self.leaks.kill_new(allow=self.kept_running)  # and whatever escaped its tree

    @property
    def daemon_id(self) -> str:
        """The daemon's id (its actor and placement-group names start with it), from its log."""
        for line in self.log_lines():
            if line.get("event") == "building engine":
                return line["instance_id"].rsplit("-g", 1)[0]
        raise AssertionError("no engine build logged yet")

    def run_record(self) -> Path:
        """The daemon's run record (``supervisor/crashrecord.py``)."""
        from supervisor.crashrecord import record_path

        return record_path(self.data_dir, f"127.0.0.1-{self.port}")

    def log_lines(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        return out

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def new_segments(self) -> set[str]:
        """``/dev/shm`` segments that appeared since this daemon started, less those another
        live daemon of this process's tests maps (its engine core holds its rings): another
        daemon's segments are not this daemon's leftovers."""
        from executor.shm import mapped_segments

        others = {pid for marker in Daemon.live_markers - {self.marker} for pid in marked_pids(marker)}
        held_by_others = mapped_segments(pids=others) if others else set()
        return (shm_segments() - self.shm_before) - held_by_others

    def kept_running(self, keep: Any = ()) -> list[int]:
        """The roots of what the test keeps running on purpose beside this daemon: the other
        live daemons of this process, the Ray heads it started as an operator, and ``keep``
        (pids, or a callable giving them: a ``ray.cluster_utils`` cluster's node processes)."""
        return [pid for marker in (Daemon.live_markers - {self.marker}) | RayHead.live_markers
                for pid in marked_pids(marker)] + list(keep() if callable(keep) else keep)

    def assert_nothing_left(self, settle_s: float = 15, keep: Any = ()) -> None:
        """Nothing of ours remains: no process started since the daemon did (its descendants,
        orphans re-parented to init included, whatever their name), no new ``/dev/shm``
        entry (whatever its name) and no new socket no process has bound in a temporary
        directory, less what the test keeps running on purpose (``kept_running``); and once
        the daemon has exited, no segment it removed still held by its resource tracker
        (``tracker_warned_of_removed``)."""
        from chaos.leaks import cmdline

        deadline = time.monotonic() + settle_s
        while True:
            pids = self.leftover_pids()
            new = self.leaks.new(allow=lambda: self.kept_running(keep))
            if not pids and not any(new.values()):
                break
            if time.monotonic() > deadline:
                cmds = {pid: cmdline(pid) for pid in pids} | new["processes"]
                raise AssertionError(f"left behind: processes {cmds}, /dev/shm {new['shm']}, dead sockets {new['sockets']}, "
                                     f"file stores {new['stores']}")
            time.sleep(0.5)
        if self.proc is not None and self.proc.poll() is not None:  # its resource tracker has ended too
            assert not (warned := self.tracker_warned_of_removed()), (
                f"the daemon's resource tracker, at its exit, still held rings the daemon had removed: {warned}")

    def tracker_warned_of_removed(self) -> set[str]:
        """The ``/dev/shm`` segments the daemon removed or found removed (its teardowns'
        ``shm_removed``, ``shm_forgotten``) that its
        ``multiprocessing`` resource tracker still held at its exit: it warned "No such file or
        directory" of each (``executor.shm.forget``)."""
        gone = set(re.findall(r"resource_tracker: '/([^']+)': \[Errno 2\]", self.log_path.read_text(errors="replace")))
        removed = {name for line in self.log_lines() for key in ("shm_removed", "shm_forgotten") for name in line.get(key) or ()}
        return gone & removed


def data_dir() -> Path:
    """Demo model cache shared by every test daemon of this run."""
    path = Path(os.environ.get("VLLM_SUPERVISOR_TEST_DATA", "/tmp/vllm-supervisor-test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def demo_model_path() -> Path:
    from supervisor.demo_model import build_demo_model

    return build_demo_model(data_dir())


class RayHead:
    """A private Ray head node (``ray start --head``), as on a real cluster; stopped by marker."""

    live_markers: set[str] = set()  # of the heads this process started and that still run

    def __init__(self, num_cpus: int = 2):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.marker = uuid.uuid4().hex
        # the operator's cluster: started, and joined by its daemons and injectors, with the operator's
        # token; this process, which starts it, is its operator
        as_operator()
        self.client_env = dict(OPERATOR_ENV)
        self.env = dict(USER_ENV, **OPERATOR_ENV, RAY_USAGE_STATS_ENABLED="0", **{MARKER_ENV: self.marker})
        self.num_cpus = num_cpus

    def start(self) -> "RayHead":
        subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1",
             f"--num-cpus={self.num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
             "--object-store-memory=268435456"],
            env=self.env, check=True, capture_output=True, timeout=120,
        )
        RayHead.live_markers.add(self.marker)
        return self

    def tool(self, *args: str) -> dict:
        """Run ``python -m chaos.inject`` against this cluster; parse its JSON."""
        out = subprocess.run(
            [sys.executable, "-m", "chaos.inject", "--address", self.address, *args],
            env=self.env, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        from executor.reaper import reap, start_time

        # The agents the raylet starts overwrite their environment (setproctitle): found
        # as the marked processes' descendants.
        RayHead.live_markers.discard(self.marker)
        marked = marked_pids(self.marker)
        reap({(pid, st) for pid in marked if (st := start_time(pid)) is not None})
        deadline = time.monotonic() + 20
        while marked_pids(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        # `ray start` wrote this head's address where a plain `ray.init()` on this machine looks for a
        # cluster; `ray stop` would remove it (`reset_ray_address`), a reap does not
        from ray._common.utils import get_ray_address_file

        with contextlib.suppress(OSError):
            address_file = Path(get_ray_address_file(None))
            if address_file.read_text().strip().endswith(f":{self.port}"):
                address_file.unlink()
