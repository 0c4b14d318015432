"""The daemon's Ray driver, in a child process of its own (``RayAgent``).

Why a process of its own (measured on Ray 2.60, docs/failure-handling.md, "Ray head loss"): when the GCS of
the cluster goes away and a new one starts on the same address, a driver that still has a
GCS call in flight (``ray.nodes()``, the actor table the standby polls, the placement-group
table) is aborted by Ray's core worker: the call retries until the new GCS answers
``WrongClusterID`` and a ``RAY_CHECK`` ends the process. ``ray.shutdown()`` does not stop a
call already in flight (measured: the abort came after it), and a driver whose GCS stays
away gives up after Ray's 60 s reconnect timeout. Whatever holds the connection must be
able to die without taking the daemon, its HTTP front and its parked streams with it.

So every Ray call of the daemon runs here, in a process the daemon starts, kills when the
GCS is lost (``kill``: the process and its children, no goodbye to a GCS that is gone) and
starts again when the GCS listens again. ``multiprocessing.managers`` carries the calls:
each calling thread gets a connection of its own and the agent serves each in a thread, so
a slow call (a placement group waiting for capacity) does not hold up the others. A call
whose agent is killed raises ``AgentGone`` in the caller's thread.

The standby's actor handles live here too: Ray ends an actor when its creator drops the
last handle, and handles cannot cross processes. The daemon names actors by id.

The agent imports no vLLM (it would hold ≈ 600 MiB for nothing): a kill by name builds a
handle without the actor's class (``executor.cluster.kill_named``). Only the agent of a daemon
with a warm standby on Ray's V2 executor imports the worker class, on a thread of its own
(``WorkerClassImport``): its first creation is the first build's, on the cold start's path.
The daemon's first agent starts that import when it is spawned, before the daemon's own
import of vLLM and before Ray (``RayAgent.spawn(preload=True)``, ``supervisor.raylink.early_agent``);
an agent spawned later (after the cluster was lost) starts it with Ray (``start_driver(preload=True)``). An import that fails is reported in the build's log
line and costs only the head start. vLLM resolves its platform lazily and not thread-safely
(``vllm.platforms.__getattr__``: check, build, set): two threads that import vLLM at once can
each build one, and the Ray device key set on one is missing on the other. So nothing else
here touches vLLM until that import is done: ``create_standby`` takes the config pickled and
unpickles it after, and the standby's other calls wait for it too.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.managers
import multiprocessing.util
import os
import pickle
import signal
import threading
import time
from typing import Any

from config import RaySettings
from executor.cluster import RayCluster, kill_handles, names_instance, private_token

AGENT_TITLE = "vllm-supervisor: ray agent"
_SOCKETS = itertools.count()


class AgentGone(RuntimeError):
    """The agent process was killed (cluster lost) or died while a call was in flight."""


class RayService(RayCluster):
    """The object the agent serves: ``RayCluster``'s calls, ``ray.init`` on a thread of its
    own, and the standby's actor handles."""

    def __init__(self, settings: dict):
        super().__init__(RaySettings(**settings))
        self.handles: dict[str, tuple[str, Any]] = {}  # actor id -> (name, handle): standbys we created
        self.class_import = WorkerClassImport()  # the standby worker's class, imported ahead when asked

    def import_worker_class(self) -> None:
        """Start importing the standby worker's class now, before Ray starts (an agent started
        ahead of the daemon's own vLLM import: ``RayAgent.spawn``)."""
        self.class_import.start()

    def start_driver(self, preload: bool = False, changed: dict[str, str] | None = None,
                     removed: list[str] | None = None) -> tuple[str, bool]:
        """``connect`` on a thread that lives as long as the agent: Ray starts a private
        cluster's GCS and raylet with a parent-death signal, which fires when the *thread* that
        started them ends (a connection's server thread ends with its connection). Returns
        the GCS address and whether a private cluster was started. ``preload``: import the
        standby worker's class (and vLLM) meanwhile, on a thread of its own.

        ``changed``/``removed``: how the daemon's environment moved since it spawned this
        agent (``RayAgent.spawn`` ran before the daemon imported vLLM and made its config),
        taken over before Ray starts: a private cluster's raylet, and so its workers, inherit
        this process's environment, as they did when the agent was spawned at the connect.
        Only values that differ are written (the worker class's import may be reading the
        environment on its thread; it sets vLLM's own variables to the same values)."""
        for key, value in (changed or {}).items():
            if os.environ.get(key) != value:
                os.environ[key] = value
        for key in removed or ():
            os.environ.pop(key, None)
        if preload:
            self.class_import.start()
        done: dict[str, Any] = {}
        ready = threading.Event()

        def run() -> None:
            try:
                done["address"] = self.connect()
            except BaseException as exc:  # handed to the caller
                done["error"] = exc
            ready.set()
            threading.Event().wait()  # keep the thread (and the cluster it started)

        threading.Thread(target=run, name="ray-driver", daemon=True).start()
        ready.wait()
        if "error" in done:
            raise done["error"]
        return done["address"], self.started_local

    def shutdown(self) -> None:
        self.handles.clear()
        super().shutdown()

    def kill_instance_actors(self, instance_id: str) -> list[str]:
        # Adopted standbys first, by handle (and their handles dropped: Ray ends an actor whose
        # creator holds none), so that a failing kill by name below cannot keep them.
        adopted = [a for a, (name, _) in self.handles.items() if names_instance(name, instance_id)]
        names = [self.handles[a][0] for a in adopted]
        kill_handles([self.handles.pop(a)[1] for a in adopted])
        return list(dict.fromkeys(names + super().kill_instance_actors(instance_id)))  # each once

    # --- the warm standby's workers (executor.standby) ----------------------------------

    def create_standby(self, pickled_config: bytes, pg: Any, instance_id: str, namespace: str, options: dict,
                       kv_bytes: int = 0) -> list[dict]:
        """``pickled_config``: the engine's ``VllmConfig``, pickled, so that it is unpickled (which
        imports vLLM) only after the worker class's import (the module's docstring says why);
        ``options``: the actor options, computed by the daemon (``executor.standby.worker_options``:
        vLLM reads them from the environment of the process it runs in, and this one's is older);
        ``kv_bytes``: the KV memory each worker reserves (``executor.kv_reserve``)."""
        self.class_import.wait()
        from executor.standby import create_standby_workers

        vllm_config = pickle.loads(pickled_config)
        workers = create_standby_workers(vllm_config, pg, instance_id, namespace, options, kv_bytes)
        for w in workers:
            self.handles[w["actor_id"]] = (w["name"], w.pop("handle"))
        return workers

    def worker_class_import(self) -> dict:
        return self.class_import.report()

    def standby_states(self, actor_ids: list[str]) -> list[dict]:
        self.class_import.wait()
        from executor.standby import actor_state

        return [actor_state(a) for a in actor_ids]

    def park_standby(self, actor_ids: list[str], wait_s: float = 5.0) -> list[list]:
        """Park each ready standby worker (``StandbyRayWorkerProc.park``); returns the address
        that wakes each, in order. The park's result is not awaited: it ends when woken."""
        self.class_import.wait()
        import ray

        handles = [self.handles[a][1] for a in actor_ids]
        addresses = ray.get([h.wake_address.remote() for h in handles], timeout=wait_s)
        for h in handles:
            h.park.remote()
        return [list(a) for a in addresses]

    def kill_standby(self, actor_ids: list[str], wait_s: float) -> None:
        """Kill standby workers and wait (bounded) until Ray has released their names."""
        self.class_import.wait()
        from executor.standby import actor_state

        kill_handles([self.handles.pop(a)[1] for a in actor_ids if a in self.handles])
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(actor_state(a)["state"] != "DEAD" for a in actor_ids):
            time.sleep(0.1)


class WorkerClassImport:
    """The standby worker's class (``executor.standby``: vLLM, torch) imported on a thread of
    the agent's own, so that the first creation does not import it on a build's path. What
    touches vLLM in the agent waits for it first (``wait``): the module's docstring says why. A
    failed or hung import is reported (``report``), and the creation then imports in its own
    thread or fails, and the build's vLLM creates its workers."""

    WAIT_S = 180.0  # the import takes 10-20 s on 2 busy cores

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: dict[str, Any] = {"asked": False}

    def start(self) -> None:
        if self._thread is None:
            self._outcome = {"asked": True, "done": False}
            self._thread = threading.Thread(target=self._run, name="worker-class-import", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            import executor.standby  # noqa: F401
            self._outcome.update(ok=True)
        except BaseException as exc:  # reported; the creation imports (and fails) in its own thread
            self._outcome.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
        self._outcome.update(done=True, took_s=round(time.monotonic() - started, 2))

    def wait(self) -> None:
        """Until the import is done (at once when none was asked for); the first wait's length
        is reported. Raises ``TimeoutError`` after ``WAIT_S``."""
        if self._thread is None:
            return
        started = time.monotonic()
        self._thread.join(self.WAIT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"the standby worker class's import is not done after {self.WAIT_S:.0f} s")
        self._outcome.setdefault("first_wait_s", round(time.monotonic() - started, 2))

    def report(self) -> dict[str, Any]:
        return dict(self._outcome)


class _Manager(multiprocessing.managers.BaseManager):
    pass


_Manager.register("RayService", RayService)


def _agent_init(daemon_pid: int) -> None:
    """In the agent, before it serves: a terminal's Ctrl-C and SIGHUP are the daemon's to
    handle (it drains, then stops the agent), not the agent's; and the agent ends when the
    daemon is gone (the crash reaper kills it too; this covers a daemon run without one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def exit_with_the_daemon() -> None:
        while os.getppid() == daemon_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_the_daemon, name="parent-watch", daemon=True).start()
    try:
        import setproctitle

        setproctitle.setproctitle(AGENT_TITLE)
    except ImportError:
        pass


class RayAgent:
    """The daemon's side: start, stop or kill the agent; ``call`` a ``RayService`` method.

    Blocks (process start, Ray calls): worker threads only, never the event loop."""

    def __init__(self, settings: RaySettings):
        self.settings = settings
        self.address = ""
        self.started_local = False
        self.preloading = False  # the worker class's import was asked for at the spawn
        self._spawn_env: dict[str, str] = {}  # this process's environment when the agent was spawned
        self._manager: _Manager | None = None
        self._service: Any = None

    @property
    def pid(self) -> int | None:
        proc = self._manager and self._manager._process
        return proc.pid if proc is not None else None

    def spawn(self, preload: bool = False) -> "RayAgent":
        """Start the agent's process, without Ray. ``preload``: it imports the standby worker's
        class from now on (a warm standby's daemon). The daemon spawns its first agent so,
        before its own import of vLLM (``supervisor.raylink.early_agent``): the two imports
        then run side by side, and the first build does not wait for the class."""
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # for the engine cores too
        if not self.settings.address:
            private_token()  # in this process's environment: the agent and the engine cores inherit it
        self._spawn_env = dict(os.environ)
        # shutdown_timeout: the join multiprocessing gives a live agent at this interpreter's exit
        # (stop and kill end it first)
        # The agent listens on a socket in this process's temporary directory (multiprocessing's
        # own, removed when this process exits, and by the crash reaper when it dies), not in one
        # of the agent's: a killed agent removes nothing, and every daemon stop left its
        # directory in /tmp (about 40 an hour under the benchmarks)
        address = os.path.join(multiprocessing.util.get_temp_dir(), f"ray-agent-{next(_SOCKETS)}")
        manager = _Manager(address=address, ctx=multiprocessing.get_context("spawn"), shutdown_timeout=30.0)
        manager.start(initializer=_agent_init, initargs=(os.getpid(),))
        self._manager = manager
        try:
            self._service = manager.RayService(self.settings.model_dump())
            if preload:
                self.call("import_worker_class")
                self.preloading = True
        except BaseException:  # an agent half made is not left behind
            self.kill()
            raise
        return self

    def env_changes(self) -> tuple[dict[str, str], list[str]]:
        """What this process's environment gained, changed and lost since the spawn."""
        now = dict(os.environ)
        return ({k: v for k, v in now.items() if self._spawn_env.get(k) != v},
                [k for k in self._spawn_env if k not in now])

    def start(self, preload: bool = False) -> str:
        """Connect the agent to Ray (spawning it first unless ``spawn`` did); returns the GCS
        address. Exports ``RAY_ADDRESS`` so that vLLM's engine-core process joins the same
        cluster. ``preload``: the agent imports the standby worker's class meanwhile."""
        if self._manager is None:
            self.spawn()
        self.address, self.started_local = self.call("start_driver", preload, *self.env_changes())
        os.environ["RAY_ADDRESS"] = self.address
        return self.address

    def call(self, method: str, *args: Any) -> Any:
        service = self._service
        if service is None:
            raise AgentGone("not connected to Ray (the cluster was lost)")
        try:
            return getattr(service, method)(*args)
        except (EOFError, OSError) as exc:  # OSError: a broken or refused connection (or Ray's own)
            if self._service is not None and self.alive():
                if isinstance(exc, (EOFError, BrokenPipeError, ConnectionError)):
                    # this thread's connection broke, not the agent: the next call makes a new one
                    service._tls.__dict__.pop("connection", None)
                raise
            raise AgentGone(f"the Ray agent is gone ({type(exc).__name__}: {exc})") from exc

    def alive(self) -> bool:
        manager = self._manager
        return manager is not None and manager._process.is_alive()

    def stop(self) -> None:
        """Disconnect from Ray (a private cluster stops with it), then end the agent and
        whatever it left. Once Ray's shutdown has returned the agent has nothing left to do,
        so it is killed, not left to exit: its own exit (the interpreter's teardown, with
        torch and vLLM imported for the warm standby) took 2.4 s of every daemon stop, measured
        on 2 cores. A shutdown call that fails ends the same way."""
        tree = self._tree()
        try:
            self.call("shutdown")
        finally:
            self.kill()
            self._reap(tree)  # what the agent started and is no longer its descendant

    def kill(self) -> list[int]:
        """SIGKILL the agent and what it started (a private cluster's processes), without a
        word to Ray: the cluster is gone, or ``stop`` has disconnected. Returns the pids killed."""
        service, self._service = self._service, None  # calls in flight now raise AgentGone
        manager, self._manager = self._manager, None
        if manager is None:
            return []
        killed = self._reap(self._tree(manager))
        manager.shutdown()  # the process is dead: this only joins it and drops the manager's state
        del service  # after the manager is shut down: its proxy does not call the dead agent
        with contextlib.suppress(OSError):
            os.unlink(manager.address)  # its socket: a killed listener does not unlink it
        return killed

    def _tree(self, manager: Any = None) -> set[tuple[int, int]]:
        """(pid, start time) of the agent and its descendants, while they run."""
        from executor.reaper import descendants, start_time

        manager = manager or self._manager
        pid = manager._process.pid if manager is not None else None
        st = start_time(pid) if pid else None
        return set() if st is None else {(pid, st)} | descendants(pid)

    @staticmethod
    def _reap(tree: set[tuple[int, int]]) -> list[int]:
        from executor.reaper import reap

        return reap(tree) if tree else []
