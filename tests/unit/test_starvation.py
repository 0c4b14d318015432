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

from health.starvation import STARVED_SHARE, sample, starved_share

BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); print('on', flush=True)\nwhile True: pass"
SLEEPY = "import time; print('on', flush=True); time.sleep(60)"


def spawn(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"on"
    return proc


def share_over(pids: list[int], window_s: float = 0.5) -> float:
    before, started = sample(pids), time.monotonic()
    time.sleep(window_s)
    return starved_share(before, sample(pids), time.monotonic() - started)


@pytest.fixture
def procs():
    made: list[subprocess.Popen] = []
    yield made
    for proc in made:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_thread_kept_off_its_cpu_reads_starved_and_a_sleeping_stopped_or_running_one_does_not(procs):
    cores = sorted(os.sched_getaffinity(0))
    # eight busy processes on one core: each runs an eighth of the time and waits the rest
    procs += [spawn(BUSY, str(cores[0])) for _ in range(8)]
    procs.append(spawn(SLEEPY))
    busy, sleepy = procs[0], procs[-1]
    assert share_over([busy.pid]) >= STARVED_SHARE
    assert share_over([sleepy.pid]) == 0.0
    os.kill(busy.pid, signal.SIGSTOP)  # a hang: not runnable, so not waiting for a CPU
    time.sleep(0.1)
    assert share_over([busy.pid]) == 0.0
    if len(cores) > 1:  # one spinning with a core to itself (a hung loop) runs: not starved
        procs.append(spawn(BUSY, str(cores[1])))
        assert share_over([procs[-1].pid]) < 0.25


def test_what_cannot_be_read_is_not_starved():
    assert sample([2**22 + 1]) == {}  # no such process (above the default pid_max)
    assert starved_share({}, {}, 0.2) == 0.0
    r, s = b"R", b"S"
    assert starved_share({1: (r, 0)}, {1: (r, 5 * 10**7)}, 0.2) == pytest.approx(0.75)  # ran 50 ms of 200
    assert starved_share({1: (r, 0)}, {1: (s, 0)}, 0.2) == 0.0  # asleep at the end: not waiting for a CPU
    assert starved_share({}, {1: (r, 0)}, 0.2) == 0.0  # a thread born meanwhile: not seen at both ends
    assert starved_share({1: (r, 0), 2: (r, 0)}, {1: (r, 2 * 10**8), 2: (r, 10**7)}, 0.2) == pytest.approx(0.95)


@pytest.mark.skipif(os.geteuid() != 0, reason="a real-time busy process needs root, as in CI")
def test_the_starvation_injector_keeps_a_process_off_its_core_and_gives_it_back(procs):
    from chaos.starve import starve

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: starving it would starve the test")
    procs.append(spawn(BUSY.replace("os.sched_setaffinity(0, {int(sys.argv[1])}); ", ""), "-"))  # unbound
    pid = procs[0].pid
    seen = {}

    def watch():
        time.sleep(0.4)
        seen["share"] = share_over([pid], 0.5)

    import threading

    thread = threading.Thread(target=watch)
    thread.start()
    info = starve(pid, 1.5, bind=True)
    thread.join()
    assert info["cores"] == [cores[0]] and seen["share"] >= 0.9, (info, seen)
    assert os.sched_getaffinity(pid) == set(cores)  # its own affinity back
    with open("/proc/sys/kernel/sched_rt_runtime_us") as fh:
        assert fh.read().strip() != "-1"  # the real-time throttling is back
    with pytest.raises(SystemExit, match="would starve the host"):
        starve(os.getpid(), 0.1)  # this process may run on every core


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def probe_with(grace_s: float, monkeypatch):
    from config import SupervisorSettings
    from health import probe as probe_mod
    from health.metrics import SupervisorMetrics

    clock = Clock()
    monkeypatch.setattr(probe_mod.time, "monotonic", clock)
    view = SimpleNamespace(cfg=SupervisorSettings(hang_starved_grace_s=grace_s), metrics=SupervisorMetrics(1))
    return probe_mod.EngineProbe(view), view, clock


def starved_seconds(view) -> float:
    return view.metrics.starved_seconds.labels("0")._value.get()


def test_a_starved_engine_gets_its_grace_then_is_hung(monkeypatch):
    probe, view, clock = probe_with(10.0, monkeypatch)
    gen = SimpleNamespace(number=3)
    assert probe._starved(0, gen, 0.1) == 0.0  # not starved: hung at once
    assert probe._starved(0, gen, 0.9) is None  # starved: the verdict waits
    clock.now += 6
    assert probe._starved(0, gen, 1.0) is None
    assert starved_seconds(view) == pytest.approx(6)
    clock.now += 5
    assert probe._starved(0, gen, 1.0) == pytest.approx(11)  # past the grace: hung, and says how long
    assert starved_seconds(view) == pytest.approx(11)
    assert probe._starved(0, gen, 1.0) is None  # (its replacement's episode would start afresh)


def test_a_starved_engine_that_stops_waiting_for_a_cpu_but_still_takes_no_step_is_hung(monkeypatch):
    probe, view, clock = probe_with(60.0, monkeypatch)
    gen = SimpleNamespace(number=1)
    assert probe._starved(0, gen, 0.8) is None
    clock.now += 3
    assert probe._starved(0, gen, 0.0) == pytest.approx(3)  # the host gave it a CPU back: a hang


def test_an_episode_ends_when_the_engine_moves_and_a_new_generation_starts_afresh(monkeypatch):
    probe, view, clock = probe_with(10.0, monkeypatch)
    assert probe._starved(0, SimpleNamespace(number=1), 1.0) is None
    clock.now += 8
    probe._moved(0)  # a step came
    assert probe._starved(0, SimpleNamespace(number=1), 1.0) is None
    clock.now += 8
    assert probe._starved(0, SimpleNamespace(number=1), 1.0) is None  # 8 s of this episode, not 16
    assert probe._starved(0, SimpleNamespace(number=2), 1.0) is None  # another engine: its own episode
    assert probe._starved(1, SimpleNamespace(number=1), 1.0) is None  # another replica's too


def test_no_grace_judges_a_starved_engine_hung_at_once(monkeypatch):
    probe, view, clock = probe_with(0.0, monkeypatch)
    assert probe._starved(0, SimpleNamespace(number=1), 1.0) == 0.0
    assert starved_seconds(view) == 0
