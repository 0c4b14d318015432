"""supervisor.standby_sched on real processes: a ready standby's threads rest under SCHED_IDLE
where they can be taken back, threads started meanwhile too, and all of them go back to the
normal policy."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from supervisor import standby_sched

# a process that starts a second thread now and a third one a second later
THREADS = """
import threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
time.sleep(1.0)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("third", flush=True)
time.sleep(60)
"""


def policies(pid: int) -> dict[int, int]:
    return {tid: os.sched_getscheduler(tid) for tid in standby_sched.threads(pid)}


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while len(standby_sched.threads(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    yield proc
    proc.kill()
    proc.wait()


def test_every_thread_rests_and_comes_back_with_those_started_meanwhile(child):
    assert standby_sched.can_rest(child.pid, standby_sched.has_cap_sys_nice()), "run as root, or with LimitNICE"
    assert standby_sched.rest([child.pid]) == ([child.pid], [])
    assert set(policies(child.pid).values()) == {os.SCHED_IDLE} and len(policies(child.pid)) == 2
    assert child.stdout.readline().strip() == "third"  # started under SCHED_IDLE: inherits it
    assert set(policies(child.pid).values()) == {os.SCHED_IDLE} and len(policies(child.pid)) == 3
    assert standby_sched.restore([child.pid]) == []
    assert set(policies(child.pid).values()) == {os.SCHED_OTHER}


def test_a_process_rests_only_where_it_can_be_taken_back(child, monkeypatch):
    # without CAP_SYS_NICE, leaving SCHED_IDLE needs the process's RLIMIT_NICE to allow nice 0
    assert standby_sched.can_rest(child.pid, privileged=True)
    monkeypatch.setattr(standby_sched, "nice_limit", lambda pid: standby_sched.NICE_0 - 1)
    assert not standby_sched.can_rest(child.pid, privileged=False)
    monkeypatch.setattr(standby_sched, "nice_limit", lambda pid: standby_sched.NICE_0)
    assert standby_sched.can_rest(child.pid, privileged=False)
    # neither: it waits at the normal policy
    monkeypatch.setattr(standby_sched, "nice_limit", lambda pid: 0)
    monkeypatch.setattr(standby_sched, "has_cap_sys_nice", lambda: False)
    assert standby_sched.rest([child.pid]) == ([], [child.pid])
    assert set(policies(child.pid).values()) == {os.SCHED_OTHER}


def test_restore_takes_back_only_what_rests(child):
    # a pid given to another process keeps its own policy: only SCHED_IDLE threads are set back
    os.sched_setscheduler(child.pid, os.SCHED_BATCH, os.sched_param(0))
    assert standby_sched.restore([child.pid]) == []
    assert os.sched_getscheduler(child.pid) == os.SCHED_BATCH


def test_the_daemon_itself_and_a_process_gone_are_left_alone():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert standby_sched.rest([os.getpid(), gone.pid]) == ([], [gone.pid])
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert standby_sched.restore([gone.pid]) == []


def test_nice_limit_reads_the_soft_limit_of_the_process():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    assert standby_sched.nice_limit(os.getpid()) == (1 << 30 if soft == resource.RLIM_INFINITY else soft)
    assert standby_sched.nice_limit(2**22 + 12345) == 0  # no such process


def test_a_process_that_refuses_is_left_as_it_was(child, monkeypatch):
    # another owner's process: EPERM on its first thread; whatever was set of it is taken back
    def refuse_after_one(pid, policy):
        os.sched_setscheduler(standby_sched.threads(pid)[0], policy, os.sched_param(0))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(standby_sched, "set_policy", refuse_after_one)
    assert standby_sched.rest([child.pid]) == ([], [child.pid])
    assert set(policies(child.pid).values()) == {os.SCHED_OTHER}
