"""vLLM's ZeroMQ socket files that a failed engine generation leaves in the RPC directory
(``executor.ipc``): a generation's are those its build made, and only those no live process
has bound are removed, at its teardown, after a failed build, or later once unbound. Real
listeners in child processes stand in for the engine core and workers: a killed one leaves
its file, as a killed engine core does. And the ``mp`` executor's torch file store, which
a killed worker leaves in the temporary directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from executor import engine as engine_mod
from executor.ipc import socket_files, sweep
from supervisor.builder import EngineBuilder

LISTEN = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
          "print('bound', flush=True); time.sleep(60)")


@pytest.fixture()
def rpc_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    return tmp_path


@pytest.fixture()
def listeners():
    made: list[subprocess.Popen] = []

    def listen(path) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", LISTEN, str(path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "bound"
        made.append(proc)
        return proc

    yield listen
    for proc in made:
        proc.kill()
        proc.wait()


def killed(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


class NoCluster:
    cluster = None

    def placement_group(self, replica):
        return None

    def kill_actors(self, instance_id):
        return []


def builder() -> EngineBuilder:
    settings = SimpleNamespace(engine=SimpleNamespace(kv_cache_space_gib=None), supervisor=SimpleNamespace(
        replicas=1, hang_first_steps=0, first_steps_timeout=lambda cpu: 60.0))
    args = SimpleNamespace(distributed_executor_backend="mp", tensor_parallel_size=1, pipeline_parallel_size=1)
    return EngineBuilder(settings=settings, engine_args=args, daemon_id="d", event_endpoint="", ray=NoCluster())


def test_the_sweep_removes_a_dead_socket_and_keeps_a_bound_one(rpc_dir, listeners):
    live, dead = listeners(rpc_dir / "live"), listeners(rpc_dir / "dead")
    killed(dead)
    (rpc_dir / "plain").write_text("not a socket")
    assert socket_files() == {str(rpc_dir / "live"), str(rpc_dir / "dead")}
    assert sweep(socket_files()) == ([str(rpc_dir / "dead")], {str(rpc_dir / "live")})
    assert sorted(p.name for p in rpc_dir.iterdir()) == ["live", "plain"]
    killed(live)
    assert sweep(socket_files()) == ([str(rpc_dir / "live")], set())


def test_a_failed_build_removes_the_sockets_it_made_and_no_other(rpc_dir, listeners, monkeypatch):
    """Another process's dead socket, there before the build began, is not the build's."""
    killed(listeners(rpc_dir / "before"))

    def failing_build(spec):
        killed(listeners(rpc_dir / "engine-core"))  # the build's engine core died during start-up
        raise RuntimeError("engine core died")

    monkeypatch.setattr(engine_mod, "build_engine", failing_build)
    b = builder()
    with pytest.raises(RuntimeError):
        b.build(1)
    b.cleanup_failed_build(1)
    assert sorted(p.name for p in rpc_dir.iterdir()) == ["before"]


def test_a_build_removes_its_hand_shakes_socket_at_once_and_keeps_the_live_ones(rpc_dir, listeners, monkeypatch):
    """vLLM closes the start-up hand-shake's socket once the engine core answered; the
    engine's other sockets stay bound while it serves and are the generation's."""
    made = {}

    def build(spec):
        made["core"] = listeners(rpc_dir / "core-input")
        killed(listeners(rpc_dir / "handshake"))
        return object()

    monkeypatch.setattr(engine_mod, "build_engine", build)
    monkeypatch.setattr(EngineBuilder, "local_procs", lambda self, engine, instance_id: [])
    b = builder()
    b.build(1)
    assert sorted(p.name for p in rpc_dir.iterdir()) == ["core-input"]
    assert b._ipc_owned[1] == {str(rpc_dir / "core-input")}


def test_a_teardown_removes_its_generations_sockets_and_later_the_one_still_bound(rpc_dir, listeners, monkeypatch):
    """A worker that has not exited yet keeps its socket bound: the teardown leaves it, and the
    sweep after the old engine's release removes it once the worker is gone."""
    core, worker = listeners(rpc_dir / "core"), listeners(rpc_dir / "worker")
    serving = listeners(rpc_dir / "other-generation")  # another replica's, made before this build
    b = builder()
    b._ipc_owned[1] = {str(rpc_dir / "core"), str(rpc_dir / "worker")}  # as ``build`` records them
    killed(core)
    monkeypatch.setattr(engine_mod, "engine_core_pids", lambda engine: [])
    monkeypatch.setattr(engine_mod, "engine_worker_pids", lambda engine: [])
    monkeypatch.setattr(engine_mod, "shutdown_engine", lambda engine, timeout_s: None)
    b.teardown(SimpleNamespace(number=1, engine=object(), failed=True, planned=False, replica=0, shm_before=None))
    assert sorted(p.name for p in rpc_dir.iterdir()) == ["other-generation", "worker"]
    killed(worker)
    assert b.sweep_sockets(wait_s=5) == [str(rpc_dir / "worker")]  # after the old engine's release
    assert sorted(p.name for p in rpc_dir.iterdir()) == ["other-generation"]
    assert serving.poll() is None and os.path.exists(rpc_dir / "other-generation")


def test_a_teardown_removes_its_generations_file_store_and_no_other(rpc_dir, monkeypatch):
    """The ``mp`` executor's workers meet through ``vllm_dist_<hex>`` in the temporary
    directory; torch removes it with its last user, so killed workers leave it. The build's
    store goes at its teardown, and at a failed build's clean-up; one there before stays."""
    import tempfile

    from torch.distributed import FileStore

    monkeypatch.setattr(tempfile, "tempdir", str(rpc_dir))
    (rpc_dir / "vllm_dist_earlier").write_bytes(b"")  # another server's, running beside this one
    stores = []

    def build(spec):  # as the workers' rendezvous does, left open as by a worker killed later
        stores.append(FileStore(os.path.join(tempfile.gettempdir(), f"vllm_dist_{len(stores)}"), 2))
        stores[-1].set("rank0", "up")
        if len(stores) == 2:
            raise RuntimeError("a worker died during start-up")
        return object()

    monkeypatch.setattr(engine_mod, "build_engine", build)
    monkeypatch.setattr(EngineBuilder, "local_procs", lambda self, engine, instance_id: [])
    monkeypatch.setattr(engine_mod, "engine_core_pids", lambda engine: [])
    monkeypatch.setattr(engine_mod, "engine_worker_pids", lambda engine: [])
    monkeypatch.setattr(engine_mod, "shutdown_engine", lambda engine, timeout_s: None)
    b = builder()
    gen = b.build(1)
    assert (rpc_dir / "vllm_dist_0").exists()
    b.teardown(gen)
    assert not (rpc_dir / "vllm_dist_0").exists()
    with pytest.raises(RuntimeError):
        b.build(2)
    b.cleanup_failed_build(2)
    assert sorted(p.name for p in rpc_dir.iterdir() if p.name.startswith("vllm_dist_")) == ["vllm_dist_earlier"]
