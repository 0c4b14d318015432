"""A starved engine is not a hung one (``health.starvation``): a thread kept off its CPU is
told from one that sleeps, is stopped or runs, read here on real processes; the starvation
injector (``chaos.starve``); and the probe's grace for a starved engine (``EngineProbe._starved``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from executor.procfs import start_time
from health.starvation import STARVED_SHARE, Episodes, Sample, sample, starved_share, window

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


def test_a_hang_says_what_its_threads_did():
    """A hang's detail says why the engine was not taken for starved: what was read of its
    threads over the check (a list of its processes that missed the worker reads as no thread
    kept waiting, and says how many threads it read)."""
    r, s = b"R", b"S"
    assert window(at({}, 0), at({}, 0.2)).describe() == "none of its threads could be read on this host"
    after = at({1: (r, 10**7), 2: (s, 2 * 10**7), 3: (s, 0)}, 0.2)
    after.names = {1: "7/worker", 2: "7/io", 3: "7/omp"}
    w = window(at({1: (r, 0), 2: (s, 0), 3: (r, 0)}, 0), after)
    assert (w.threads, w.runnable, w.ran, w.waited) == (3, 1, pytest.approx(0.15), pytest.approx(0.95))
    assert w.describe() == ("over 0.2 s its 3 threads on this host ran 15% of a core (the most, 7/io, 10%), "
                            "1 runnable throughout, the most kept waiting for a CPU 95% of the time")
    me = os.getpid()
    assert sample([(me, None)]).names[me] == f"{me}/{open(f'/proc/{me}/comm').read().strip()}"


def test_a_thread_given_its_cpu_back_after_a_long_wait_reads_starved():
    """A starvation that ends as the stall is checked: the worker catches up, its threads busy
    (93 % of a core in the window), and one of them just came back from a 4 s wait for a CPU
    (its run-queue wait grew by 4.2 s within 0.2 s). Starved, not a busy hang; a wait of 0.9 s
    beyond the window is not."""
    r = b"R"
    before, after = at({1: (r, 0), 2: (r, 0)}, 0), at({1: (r, 186 * 10**6), 2: (r, 0)}, 0.2)
    before.delays, after.delays = {1: 0, 2: 0}, {1: 4_200 * 10**6, 2: 0}
    w = window(before, after)
    assert w.came_back_s == pytest.approx(4.0) and w.ran == pytest.approx(0.93) and w.starved_share == 1.0
    assert w.describe().endswith(", one given a CPU back after waiting 4.0 s")
    after.delays = {1: 1_100 * 10**6, 2: 0}
    assert window(before, after).starved_share == 0.0


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
        os.sched_setaffinity(0, set(cores[1:]))  # this thread: off the starved core
        while os.sched_getscheduler(pid) != os.SCHED_IDLE:  # the busy processes are up: demoted
            time.sleep(0.01)
        demoted = time.monotonic()
        time.sleep(0.3)
        seen["share"] = share_over([pid], 0.8)
        time.sleep(2.2 - (time.monotonic() - demoted))
        before = sample([(pid, None)])  # ... and across the starvation's end, 2.5 s in
        time.sleep(0.6)
        seen["came_back_s"] = window(before, sample([(pid, None)])).came_back_s

    thread = threading.Thread(target=watch)
    thread.start()
    info = starve(pid, 2.5, bind=True)
    thread.join()
    assert info["cores"] == [cores[0]] and seen["share"] >= 0.9, (info, seen)
    # given its core back, it ran at once, after a wait of about 2.4 s: 1.8 s beyond the window
    assert seen["came_back_s"] >= 1.0, (info, seen)
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


def test_a_busy_window_beside_a_starved_thread_is_read_again_once_vllms_spin_is_over(monkeypatch):
    """The starved worker got a moment to send one reply (seen: 11 ms of its thread 3 s in): its
    engine core read it and polls for the next for a second (vLLM's ``SpinCondition``), 93 % of a
    core, while the worker's thread waits for a CPU. Busy, so that window alone read as a hang
    (CI, 2026-11-29: "no engine step for 4.7 s"). It is read again ``SPIN_S`` later: the engine
    core asleep, the worker starved. An engine still busy then is spinning in a loop: a hang."""
    import health.probe as hp

    r, s = b"R", b"S"

    def look(core_ran: float) -> list[Sample]:  # thread 1: the engine core; 2: the starved worker's
        return [at({1: (r, 0), 2: (r, 0)}, 0), at({1: (r if core_ran else s, int(core_ran * 2e8)), 2: (r, 0)}, 0.2)]

    monkeypatch.setattr(hp, "SPIN_S", 0.0)
    monkeypatch.setattr(hp, "CONFIRM_S", 0.0)
    monkeypatch.setattr(hp, "stalled", lambda *args, **kwargs: "no engine step for 4.2 s")
    p = Probe(grace_s=60.0)
    gen = SimpleNamespace(number=1, local_procs=[], failed=False)
    p.view.held, p.view.ready, p.view.released_monotonic = (lambda: False), (lambda: True), 0.0
    p.probe._current = lambda replica: gen
    for looks, (ran, share) in (([0.93, 0.0], (0.0, 1.0)), ([0.93, 0.95], (0.95, 0.0)), ([0.0], (0.0, 1.0))):
        samples = iter([x for core_ran in looks for x in look(core_ran)])
        monkeypatch.setattr(hp, "sample", lambda procs: next(samples))
        problem, threads = asyncio.run(p.probe._confirm(0, gen))
        assert problem and (threads.ran, threads.starved_share) == (pytest.approx(ran), share), looks
        assert next(samples, None) is None, looks  # a second look only after an ambiguous first
    assert window(*look(0.95)).ambiguous and not window(*look(0.3)).ambiguous
