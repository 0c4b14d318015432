"""The crash reaper and the run record, on real processes (no Ray, no vLLM): a stand-in
daemon starts the reaper exactly as the daemon does, forks a process tree and leaves a
``/dev/shm`` segment; SIGKILL of the stand-in must take all of it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path


from executor.reaper import descendants, last_pid, process_table, read_pids, reap, start_time
from supervisor import crashrecord

ROOT = Path(__file__).resolve().parents[2]

STAND_IN = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    from supervisor.crashrecord import RunRecord
    import multiprocessing.util, socket, tempfile
    runtime_dir = tempfile.mkdtemp(prefix="vllm-supervisor-")  # as the daemon's own, with its event socket
    record = RunRecord(Path(sys.argv[1]), (Path(runtime_dir),))
    control = socket.socket(socket.AF_UNIX)  # its control socket, in the temporary directory itself
    control.bind(sys.argv[4])
    control.listen()
    record.start_reaper(sys.argv[4])
    record.write("vsup-test", "", sys.argv[4])
    # a child with its own child, and one that renames itself (no environment marker to find)
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"])
    subprocess.Popen(["sleep", "301"])
    Path("/dev/shm/" + sys.argv[2]).write_bytes(b"ring")
    # a listener in this process's multiprocessing directory, as the fork server's and the Ray
    # agent's, and one in its runtime directory, as its event socket
    listeners = [socket.socket(socket.AF_UNIX) for _ in range(2)]
    listeners[0].bind(os.path.join(multiprocessing.util.get_temp_dir(), "listener-test"))
    listeners[1].bind(os.path.join(runtime_dir, "events-test.sock"))
    for listener in listeners:
        listener.listen()
    print("up", multiprocessing.util.get_temp_dir(), runtime_dir, flush=True)
    if sys.argv[3] == "late":  # a child started after a quiet while
        sys.stdin.readline()
        subprocess.Popen(["sleep", "302"])
        print("spawned", flush=True)
    if sys.argv[3] == "clean":
        sys.stdin.readline()
        record.close_clean()
        print("closed", flush=True)
    time.sleep(300)
""")


def wait_for(predicate, timeout_s: float = 15.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def start_stand_in(tmp_path: Path, mode: str):
    segment = f"psm_reapertest{uuid.uuid4().hex[:8]}"
    record = tmp_path / "run" / "daemon-test-1.json"
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN, str(record), segment, mode, str(tmp_path / "control.sock")], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    up, *temp_dirs = proc.stdout.readline().split()
    assert up == b"up"
    # 1 child + its sleep + 1 sleep (not the reaper itself), snapshotted into the pids file
    wait_for(lambda: len(read_pids(crashrecord.pids_path(record, proc.pid))) >= 3, what="the reaper's snapshot")
    return proc, record, segment, [Path(d.decode()) for d in temp_dirs]


def test_sigkill_of_the_daemon_takes_its_process_tree_and_shared_memory(tmp_path):
    proc, record, segment, temp_dirs = start_stand_in(tmp_path, "crash")
    tree = descendants(proc.pid)
    assert len(tree) == 4
    assert temp_dirs[0].name.startswith("pymp-") and (temp_dirs[0] / "listener-test").is_socket()
    assert temp_dirs[1].name.startswith("vllm-supervisor-") and (temp_dirs[1] / "events-test.sock").is_socket()
    proc.kill()
    proc.wait()
    wait_for(lambda: all(start_time(pid) != st for pid, st in tree), what="the tree to be reaped")
    wait_for(lambda: not Path("/dev/shm", segment).exists(), what="the segment to be removed")
    wait_for(lambda: not any(d.exists() for d in temp_dirs), what="the daemon's temporary directories to be removed")
    wait_for(lambda: not (tmp_path / "control.sock").exists(), what="its control socket to be removed")
    wait_for(lambda: not crashrecord.pids_path(record, proc.pid).exists(), what="the pids file to go")
    # the record stays: the next daemon on this port sees that its predecessor crashed
    assert crashrecord.read_predecessor(record).pid == proc.pid


def test_a_process_started_after_a_quiet_while_is_snapshotted_and_reaped(tmp_path):
    """The reaper reads the process table only when a pid was given out since its last read
    (``last_pid``): a child started after seconds of quiet is in the next snapshot all the same."""
    before = last_pid()
    subprocess.run(["true"], check=True)
    assert last_pid() not in (None, before)
    proc, record, segment, temp_dirs = start_stand_in(tmp_path, "late")
    tree = descendants(proc.pid)
    try:
        time.sleep(2.0)  # quiet: the reaper's checks read /proc/loadavg alone
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"spawned"
        tree = descendants(proc.pid)
        assert len(tree) == 5  # the reaper, 1 child + its sleep, 1 sleep, the late sleep
        wait_for(lambda: len(read_pids(crashrecord.pids_path(record, proc.pid))) >= 4, timeout_s=3.0,
                 what="the late child in the reaper's snapshot")
        proc.kill()
        proc.wait()
        wait_for(lambda: all(start_time(pid) != st for pid, st in tree), what="the tree to be reaped")
        wait_for(lambda: not Path("/dev/shm", segment).exists(), what="the segment to be removed")
        wait_for(lambda: not any(d.exists() for d in temp_dirs), what="the daemon's temporary directories to be removed")
    finally:  # a failure leaves nothing either
        proc.kill()
        reap(tree)
        Path("/dev/shm", segment).unlink(missing_ok=True)
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_a_clean_stop_leaves_everything_to_the_daemon(tmp_path):
    proc, record, segment, temp_dirs = start_stand_in(tmp_path, "clean")
    tree = descendants(proc.pid)
    try:
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"closed"
        assert not record.exists() and not crashrecord.pids_path(record, proc.pid).exists()
        time.sleep(1.0)
        alive = [pid for pid, st in tree if start_time(pid) == st]
        assert len(alive) == 3  # the reaper exited; the daemon's own children untouched
        assert Path("/dev/shm", segment).exists() and all(d.exists() for d in temp_dirs)
        assert (tmp_path / "control.sock").is_socket()  # the daemon's own stop removes it
    finally:
        proc.kill()
        reap(tree)
        Path("/dev/shm", segment).unlink(missing_ok=True)
        for d in temp_dirs:  # the daemon's own stop removes them
            shutil.rmtree(d, ignore_errors=True)


def test_the_next_start_reaps_what_a_dead_reaper_could_not(tmp_path):
    """Both the daemon and its reaper killed (an OOM kill of the whole group): the successor
    kills the tree from the pids file, removes stale segments, a stale control socket and the
    predecessor's multiprocessing directory."""
    proc, record, segment, temp_dirs = start_stand_in(tmp_path, "crash")
    tree = descendants(proc.pid)
    reaper = json.loads(record.read_text())["reaper"][0]
    os.kill(reaper, signal.SIGKILL)
    proc.kill()
    proc.wait()
    assert (tmp_path / "control.sock").is_socket()  # its control socket, bound by no one now: stale
    os.utime(Path("/dev/shm", segment), (time.time() - 60, time.time() - 60))
    pred = crashrecord.read_predecessor(record)
    assert pred is not None and pred.daemon_id == "vsup-test"
    cleaned = crashrecord.clean_local(pred, record)
    try:
        assert len(cleaned["processes_killed"]) == 3
        assert segment in cleaned["shm_removed"] and cleaned["control_socket_removed"]
        assert not (tmp_path / "control.sock").exists()
        assert cleaned["temp_dirs_removed"] == [str(d) for d in temp_dirs] and not any(d.exists() for d in temp_dirs)
        wait_for(lambda: all(start_time(pid) != st for pid, st in tree), what="the tree to be reaped")
    finally:
        reap(tree)
        Path("/dev/shm", segment).unlink(missing_ok=True)
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


def test_a_live_predecessor_or_a_foreign_record_is_left_alone(tmp_path):
    record = tmp_path / "daemon.json"
    record.write_text(json.dumps({"pid": os.getpid(), "start_time": start_time(os.getpid()), "daemon_id": "me"}))
    os.chmod(record, 0o600)
    assert crashrecord.read_predecessor(record) is None  # alive: not ours to clean
    record.write_text(json.dumps({"pid": os.getpid(), "start_time": 1, "daemon_id": "old"}))
    assert crashrecord.read_predecessor(record).daemon_id == "old"  # same pid, other start time: reused pid
    os.chmod(record, 0o666)
    assert crashrecord.read_predecessor(record) is None  # others may write it: not trusted
    os.chmod(record, 0o600)
    record.write_text("{not json")
    assert crashrecord.read_predecessor(record) is None
    assert crashrecord.read_predecessor(tmp_path / "absent.json") is None


def test_reap_never_kills_a_reused_pid():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        assert reap({(sleeper.pid, start_time(sleeper.pid) + 1)}) == []
        assert sleeper.poll() is None
        assert reap({(sleeper.pid, start_time(sleeper.pid))}) == [sleeper.pid]
        assert sleeper.wait(5) == -signal.SIGKILL
    finally:
        sleeper.kill()


def test_process_table_sees_this_process():
    assert os.getpid() in process_table()


def test_a_dead_daemons_control_socket_goes_unless_bound_again(tmp_path):
    """The next daemon on the same port binds the same path: the reaper of the one before
    leaves that alone, and any file that is not a socket."""
    from executor.reaper import remove_dead_socket

    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(tmp_path / "dead.sock"))
    (tmp_path / "plain").write_text("not a socket")
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(tmp_path / "live.sock"))
        live.listen()
        assert remove_dead_socket(str(tmp_path / "dead.sock"))
        assert not remove_dead_socket(str(tmp_path / "live.sock"))
        assert not remove_dead_socket(str(tmp_path / "plain")) and not remove_dead_socket("")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["live.sock", "plain"]
