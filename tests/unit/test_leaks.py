"""The leak check sees what it does not know: a process orphaned to init whatever its name, a
child, a ``/dev/shm`` entry of a new kind; and it spares what the caller keeps on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from chaos.leaks import SHM, Leaks, processes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def orphan() -> int:
    """A process whose parent exits at once (a double fork): re-parented to init."""
    out = subprocess.run([sys.executable, "-c",
                          "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
                          *SLEEPER], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_an_orphan_a_child_and_a_new_segment_are_found_and_an_allowed_tree_is_not():
    leaks = Leaks()
    assert leaks.new() == {"processes": {}, "shm": [], "sockets": [], "stores": []}
    lost = orphan()
    child = subprocess.Popen(SLEEPER)
    kept = subprocess.Popen(SLEEPER)
    segment = SHM / f"never-heard-of-{uuid.uuid4().hex}"
    segment.write_bytes(b"x")
    try:
        time.sleep(0.2)
        left = leaks.new(allow=lambda: [kept.pid])
        assert lost in left["processes"] and child.pid in left["processes"], left
        assert kept.pid not in left["processes"], left
        assert left["shm"] == [segment.name], left
        leaks.kill_new(allow=lambda: [kept.pid])
        child.wait(5)
        assert leaks.wait_clean(settle_s=5, allow=lambda: [kept.pid]) == {}
        assert kept.poll() is None and lost not in processes()  # killed (a zombie until init reaps it)
    finally:
        for p in (child, kept):
            p.kill()
            p.wait()
        segment.unlink(missing_ok=True)
        try:
            os.kill(lost, 9)
        except ProcessLookupError:
            pass


def test_a_socket_left_by_a_killed_process_is_found_and_a_bound_one_is_not():
    """A process killed with its listener in a ``pymp-*`` directory (what the Ray agent left at
    every daemon stop) leaves a socket nobody has bound; a live listener's is not a leftover."""
    import shutil
    import signal
    import tempfile

    leaks = Leaks()
    where = tempfile.mkdtemp(prefix="pymp-")
    listen = ("import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
              "print('up', flush=True); time.sleep(60)")
    dead, live = os.path.join(where, "listener-dead"), os.path.join(where, "listener-live")
    procs = [subprocess.Popen([sys.executable, "-c", listen, path], stdout=subprocess.PIPE) for path in (dead, live)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == b"up"
        assert leaks.new(allow=lambda: [p.pid for p in procs])["sockets"] == []  # both bound
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        assert leaks.new(allow=lambda: [procs[1].pid])["sockets"] == [dead]
        procs[1].kill()
        procs[1].wait()
        leaks.kill_new()
        assert not os.path.exists(where), "kill_new leaves the dead sockets' directory once it is empty"
        assert leaks.wait_clean(settle_s=1) == {}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(where, ignore_errors=True)


def test_a_dead_socket_in_the_temporary_directory_itself_counts_unless_told_not_to(tmp_path, monkeypatch):
    """vLLM's ZeroMQ sockets go in the temporary directory itself unless told otherwise: they
    count (the daemon leaves none; `vllm serve`, which leaves 7, gets a directory of its own)."""
    import socket
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    everywhere, below = Leaks(), Leaks(top_sockets=False)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "0b5a4526-ce9e-43e6-9c86-e6bd751e83cb"))  # closed unbound: as a killed process's
    assert everywhere.new()["sockets"] == [str(tmp_path / "0b5a4526-ce9e-43e6-9c86-e6bd751e83cb")]
    assert below.new()["sockets"] == []
    everywhere.kill_new()
    assert everywhere.new()["sockets"] == [] and tmp_path.exists()


def test_a_new_file_store_in_the_temporary_directory_is_a_leftover(tmp_path, monkeypatch):
    """The ``mp`` executor's rendezvous file (torch removes it with its last user, unless that
    user was killed); one there before is not new."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "vllm_dist_old").write_bytes(b"\0")
    leaks = Leaks()
    (tmp_path / "vllm_dist_0c7e").write_bytes(b"\0")
    (tmp_path / "other_file").write_bytes(b"\0")
    assert leaks.new()["stores"] == [str(tmp_path / "vllm_dist_0c7e")]
    assert leaks.wait_clean(settle_s=0) != {}
    leaks.kill_new()
    assert leaks.new()["stores"] == [] and sorted(p.name for p in tmp_path.iterdir()) == ["other_file", "vllm_dist_old"]
