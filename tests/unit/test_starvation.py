"""A starved engine is not a hung one (``health.starvation``): a thread kept off its CPU is
told from one that sleeps, is stopped or runs, read here on real processes; the starvation
injector (``chaos.starve``); and the probe's grace for a starved engine (``EngineProbe._starved``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from executor.procfs import start_time
from health.starvation import STARVED_SHARE, Episodes, Sample, sample, starved_share

BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); print('on', flush=True)\nwhile True: pass"
SLEEPY = "import time; print('on', flush=True); time.sleep(60)"


def spawn(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"on"
    return proc


def share_over(pids: list[int], window_s: float = 0.5) -> float:
    before = sample([(p, None) for p in pids])
    time.sleep(window_s)
    return starved_share(before, sample([(p, None) for p in pids]))


@pytest.fixture
def procs():
    made: list[subprocess.Popen] = []
    yield made
    stop(made)


def stop(made: list[subprocess.Popen]) -> None:
    for proc in made:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    made.clear()


def test_a_thread_kept_off_its_cpu_reads_starved_and_a_sleeping_stopped_or_running_one_does_not(procs):
    cores = sorted(os.sched_getaffinity(0))
    # eight busy processes on one core: each runs an eighth of the time and waits the rest
    procs += [spawn(BUSY, str(cores[0])) for _ in range(8)]
    busy = procs[0]
    assert share_over([busy.pid]) >= STARVED_SHARE
    # ... but together they burn the core: an engine that spins (a hung loop) is not starved
    assert share_over([p.pid for p in procs]) == 0.0
    os.kill(busy.pid, signal.SIGSTOP)  # a hang: not runnable, so not waiting for a CPU
    time.sleep(0.1)
    assert share_over([busy.pid]) == 0.0
    stop(procs)
    procs.append(spawn(SLEEPY))
    assert share_over([procs[0].pid]) == 0.0
    procs.append(spawn(BUSY, str(cores[-1])))  # spinning with a core to itself: it runs
    assert share_over([procs[1].pid]) == 0.0


def at(threads: dict, t: float) -> Sample:
    return Sample(threads, t)


def test_the_share_from_two_samples():
    r, s = b"R", b"S"
    assert sample([(2**22 + 1, None)]).threads == {}  # no such process (above the default pid_max)
    me = os.getpid()
    assert sample([(me, start_time(me))]).threads  # this process, as recorded
    assert sample([(me, start_time(me) + 1)]).threads == {}  # another process on a reused pid
    assert starved_share(at({}, 0), at({}, 0.2)) == 0.0
    assert starved_share(at({1: (r, 0)}, 0), at({1: (r, 5 * 10**7)}, 0.2)) == pytest.approx(0.75)  # ran 50 of 200 ms
    assert starved_share(at({1: (r, 0)}, 0), at({1: (s, 0)}, 0.2)) == 0.0  # asleep at the end: not waiting for a CPU
    assert starved_share(at({}, 0), at({1: (r, 0)}, 0.2)) == 0.0  # a thread born meanwhile: not seen at both ends
    assert starved_share(at({1: (r, 0), 2: (r, 0)}, 0), at({1: (r, 10**7), 2: (r, 2 * 10**7)}, 0.2)) == pytest.approx(0.95)
    # the engine's threads together ran half the window: busy, not starved, whatever one waited
    assert starved_share(at({1: (r, 0), 2: (r, 0)}, 0), at({1: (r, 10**8), 2: (r, 0)}, 0.2)) == 0.0
    assert starved_share(at({1: (r, 0)}, 1.0), at({1: (r, 0)}, 1.0)) == 0.0  # no window


@pytest.mark.skipif(os.geteuid() != 0, reason="busy processes at nice -20 need root, as in CI")
def test_the_starvation_injector_keeps_a_process_off_its_core_and_gives_it_back(procs):
    import threading

    from chaos.starve import starve

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: starving it would starve the test")
    procs.append(spawn(BUSY.replace("os.sched_setaffinity(0, {int(sys.argv[1])}); ", ""), "-"))  # unbound
    pid = procs[0].pid
    seen = {}

    def watch():
        time.sleep(0.8)  # the busy processes are up and the target demoted well before
        seen["share"] = share_over([pid], 0.8)

    thread = threading.Thread(target=watch)
    thread.start()
    info = starve(pid, 2.5, bind=True)
    thread.join()
    assert info["cores"] == [cores[0]] and seen["share"] >= 0.9, (info, seen)
    assert os.sched_getaffinity(pid) == set(cores) and os.sched_getscheduler(pid) == os.SCHED_OTHER  # its own back
    assert share_over([pid]) == 0.0  # it runs again
    with pytest.raises(SystemExit, match="everything would starve"):
        starve(os.getpid(), 0.1)  # this process may run on every core


class Probe:
    """An EngineProbe with a settings and metrics view, its clock given by the test."""

    def __init__(self, grace_s: float, hang_timeout_s: float = 4.0):
        from config import SupervisorSettings
        from health.metrics import SupervisorMetrics
        from health.probe import EngineProbe

        self.view = SimpleNamespace(cfg=SupervisorSettings(hang_starved_grace_s=grace_s, hang_timeout_s=hang_timeout_s),
                                    metrics=SupervisorMetrics(1))
        self.probe = EngineProbe(self.view)
        self.now = 1000.0

    def judge(self, share: float, number: int = 1, replica: int = 0, after: float = 0.0) -> str | None:
        self.now += after
        return self.probe._starved(replica, SimpleNamespace(number=number), share, now=self.now)

    def counted(self) -> float:
        return self.view.metrics.starved_seconds.labels("0")._value.get()


def test_a_starved_engine_gets_its_grace_then_is_hung():
    p = Probe(grace_s=10.0)
    assert p.judge(0.1) == ""  # not starved: hung at once, as before
    assert p.judge(0.9) is None  # starved: the verdict waits
    for _ in range(8):
        assert p.judge(1.0, after=0.7) is None
    assert p.counted() == pytest.approx(0.2 + 8 * 0.7)  # the confirmation, then each check's period
    assert p.judge(1.0, after=5.0).startswith("; its threads starved of CPU for 11 s, past hang_starved_grace_s")
    assert p.counted() == pytest.approx(0.2 + 9 * 0.7)  # a gap between checks counts one period at most


def test_given_its_cpu_back_an_engine_has_hang_timeout_s_to_step_then_is_hung():
    p = Probe(grace_s=60.0, hang_timeout_s=4.0)
    assert p.judge(0.8) is None
    assert p.judge(1.0, after=3.0) is None
    assert p.judge(0.0, after=0.7) is None  # its CPU back 0.7 s ago: it finishes the step it was kept from
    assert p.judge(0.0, after=3.0) is None
    assert p.judge(0.0, after=0.5) == "; 4.2 s after its threads were last seen starved of CPU"  # no step yet: a hang


def test_an_episode_ends_when_the_engine_steps_and_each_generation_and_replica_has_its_own():
    p = Probe(grace_s=10.0)
    episodes = p.probe.starvation
    assert p.judge(1.0) is None
    assert episodes.moved(0, 1, last_progress=p.now - 1) is None  # no step since it was seen starved
    assert p.judge(1.0, after=8.0) is None
    assert episodes.moved(0, 1, last_progress=p.now + 0.1) == pytest.approx(8.0)  # a step came: the episode ends
    assert p.judge(1.0, after=8.0) is None  # a new episode: 0 s of it, not 16
    assert p.judge(1.0, after=2.5) is None  # 2.5 s of it
    assert p.judge(1.0, after=8.0) is not None  # 10.5 s: past its grace
    assert p.judge(1.0, number=2) is None and p.judge(1.0, replica=1) is None  # a new generation, another replica: afresh


def test_no_grace_judges_a_starved_engine_hung_at_once():
    p = Probe(grace_s=0.0)
    assert p.judge(1.0) == ""
    assert p.counted() == 0
