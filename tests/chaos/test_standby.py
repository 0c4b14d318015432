"""The warm standby on a real daemon (TP=1, Ray, vLLM): a worker kill is recovered in the
standby's pre-started process, with the clients' text exact; a killed standby is replaced
without touching the serving engine; a worker starved of CPU is not taken for a hung one;
requests that arrive during a recovery wait in the admission queue or get a 503; stop leaves
nothing. (TP=2 adoption is asserted by
``test_recovery.py``'s first kill.)"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from chaos import inject
from executor import procfs
from executor.procfs import children
from supervisor import standby_sched
from chaos.load import PROMPTS, as_reference, compare, run_with_fault
from tests.chaos.test_recovery import (FAST_PROBES, MAX_TOKENS, _batch, assert_all_exact, assert_clean_generation, finish,
                                      start_daemon, stop_leaves_nothing, wait_state)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tp1(tmp_path_factory, ray_head):
    # a small admission queue for the arrivals during a recovery (the other tests' streams are
    # running when their fault lands: continued, not admitted)
    with start_daemon(tmp_path_factory.mktemp("standby"), ray_head, tp=1, max_restarts=20, admission_queue_size=2) as d:
        d.wait_ready()
        inject.prepare(ray_head.address)
        ref = as_reference(asyncio.run(run_with_fault(d.base_url, len(PROMPTS), MAX_TOKENS))[0])
        yield d, ref
        finish(d, ray_head)


def adoptions_total(daemon, result: str) -> float:
    """``vllm_supervisor_standby_adoptions_total{result=...}`` (the series exists from start-up)."""
    metrics = httpx.get(daemon.base_url + "/metrics/supervisor").text
    series = f'vllm_supervisor_standby_adoptions_total{{result="{result}"}} '
    values = [float(line[len(series):]) for line in metrics.splitlines() if line.startswith(series)]
    assert len(values) == 1, [line for line in metrics.splitlines() if "adoptions_total" in line]
    return values[0]


GiB = 2**30


def rss_bytes(pid: int) -> int:
    """A process's resident memory, from ``/proc``."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def process_state(pid: int) -> str:
    """``pid``'s state letter (``/proc/<pid>/stat``): "T" when stopped, "?" when gone."""
    return (procfs.stat(pid) or [b"?"])[0].decode()


def main_thread_switches(pid: int, window_s: float) -> int:
    """How often a process's main thread gave up its core by itself (it went to sleep: each
    wake-up from a wait counts one) over ``window_s``, from ``/proc``."""
    def switches() -> int:
        for line in open(f"/proc/{pid}/task/{pid}/status"):
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
        raise AssertionError(f"no voluntary_ctxt_switches for pid {pid}")

    before = switches()
    time.sleep(window_s)
    return switches() - before


def worker_log(pid: int, waiting_for: str, timeout_s: float = 15.0) -> str:
    """A Ray worker's stdout log (``<temp dir>/session_*/logs/worker-*-<pid>.out``: the tests'
    heads use Ray's default temp dir), once it holds ``waiting_for``, else as it is."""
    text, deadline = "", time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = sorted(glob.glob(f"/tmp/ray/session_*/logs/worker-*-{pid}.out"), key=os.path.getmtime)
        text = Path(files[-1]).read_text(errors="replace") if files else ""
        if waiting_for in text:
            break
        time.sleep(0.5)
    return text


def thread_policies(pid: int) -> set[int]:
    """The scheduling policies of a process's threads (``sched_getscheduler`` of each)."""
    return {os.sched_getscheduler(tid) for tid in standby_sched.threads(pid)}


def exact(records, ref) -> None:
    summary = compare(records, ref)
    assert summary["failed"] == 0, [(r.status, r.error) for r in records if r.outcome != "ok"]
    assert summary["mismatched"] == 0, summary


def test_the_first_build_adopts_the_workers_it_started_beside_its_engine_core(tp1, ray_head):
    """A cold build with a warm standby starts its own workers as standbys before its engine
    core imports vLLM (``StandbyWorkers.starter``), in a Ray agent that imported their class
    ahead, beside Ray's start (``WorkerClassImport``); its executor adopts them."""
    daemon, _ = tp1
    lines = daemon.log_path.read_text(errors="replace").splitlines()
    assert not [line for line in lines if "could not start the build's workers" in line], "the early start failed"
    started = [json.loads(line) for line in lines if "the build's workers start beside its engine core" in line]
    assert started and started[0]["engine_generation"] == 1, started
    # the agent imported the class ahead, and the creation waited for that import
    imported = started[0]["class_import"]
    assert imported["asked"] and imported["ok"] and "first_wait_s" in imported, imported
    up = re.compile(r"generation 1: 1 Ray worker actor\(s\) up: .*adopted standby ranks: \[0\]")
    assert any(up.search(line) for line in lines), [line for line in lines if "worker actor(s) up" in line]


def test_kill_is_recovered_in_the_standby_process(tp1, ray_head):
    daemon, ref = tp1
    s = daemon.wait_standby()
    gen = s["generation"]
    standby = s["standby"]
    assert standby["for_generation"] == gen + 1 and standby["forkserver_pid"]
    standby_pids = [w["pid"] for w in standby["workers"]]
    assert len(standby_pids) == 1 and all(standby_pids)
    serving_pids = [w["pid"] for w in daemon.full_status()["workers"]]
    assert set(serving_pids).isdisjoint(standby_pids)
    # the model runs at the daemon's priority, not at the nice 15 Ray gives its workers (unless
    # whoever runs the tests exported RAY_worker_niceness, as an operator would)
    expected = int(os.environ.get("RAY_worker_niceness", "").strip() or os.getpriority(os.PRIO_PROCESS, daemon.proc.pid))
    assert {p: os.getpriority(os.PRIO_PROCESS, p) for p in serving_pids + standby_pids} == {
        p: expected for p in serving_pids + standby_pids}
    adopted_before = adoptions_total(daemon, "adopted")
    cold_before = adoptions_total(daemon, "cold")
    # the standby holds its KV cache's memory already, faulted in (executor.kv_reserve; the
    # daemon's default KV size on CPU is 1 GiB)
    reserved_rss = rss_bytes(standby_pids[0])
    assert reserved_rss > GiB, f"standby worker's RSS {reserved_rss / GiB:.2f} GiB: its KV memory is not reserved"
    # stopped while ready (supervisor.standby_sched.stop): its Ray threads do not wake at all
    # (under SCHED_IDLE alone they woke 56 times a second)
    assert standby["stopped"] == standby_pids and process_state(standby_pids[0]) == "T", standby
    # and parked under it, as a standby on another node (which the daemon cannot stop) waits: its
    # main thread sleeps on the wake-up socket instead of Ray's 10 ms signal check (about 100
    # wake-ups a second awake; the park itself ends every PARK_S = 2 s). Measured with the worker
    # continued for the window, and stopped again after it, as the daemon left it.
    os.kill(standby_pids[0], signal.SIGCONT)
    try:
        woke = main_thread_switches(standby_pids[0], 3.0)
    finally:
        os.kill(standby_pids[0], signal.SIGSTOP)
    assert woke < 30, f"the ready standby's main thread woke {woke} times in 3 s: it is not parked"
    # and its parks (one every PARK_S) leave no record in the cluster's task table, where they
    # would crowd an operator's own tasks out of `ray list tasks` (1,800 an hour per worker)
    assert inject.task_records(ray_head.address, "park") == {}, "the standby's parks are recorded as Ray tasks"
    # while ready, every thread of its worker and of the fork server rests under SCHED_IDLE
    # (supervisor.standby_sched; root here can take it back), the serving workers do not
    forkserver = standby["forkserver_pid"]
    assert standby["resting"] == sorted([standby_pids[0], forkserver])
    assert {p: thread_policies(p) for p in standby["resting"]} == {p: {os.SCHED_IDLE} for p in standby["resting"]}
    assert {p: thread_policies(p) for p in serving_pids} == {p: {os.SCHED_OTHER} for p in serving_pids}

    records, info = asyncio.run(run_with_fault(daemon.base_url, 4, MAX_TOKENS, lambda: inject.kill_worker(ray_head.address, rank=0)))
    after = daemon.wait_generation(gen + 1)
    exact(records, ref)
    # this recovery's build adopted the standby: counted once, as adopted, not as cold
    assert (adoptions_total(daemon, "adopted"), adoptions_total(daemon, "cold")) == (adopted_before + 1, cold_before), (
        f"adoptions_total adopted {adopted_before} -> {adoptions_total(daemon, 'adopted')}, "
        f"cold {cold_before} -> {adoptions_total(daemon, 'cold')}; recoveries {after['recoveries'][-1:]}")
    rec = after["recoveries"][-1]
    assert rec["ok"] and rec["from_generation"] == gen and rec["reason"] == "worker_death" and rec["cause"] == "killed", rec
    assert "rank(s) [0]" in rec["detail"] and info["killed"] in rec["detail"], rec
    assert rec["standby"] == {"result": "adopted", "adopted_ranks": [0]}, rec
    # the new generation's worker is the standby's process, started before the fault, running
    assert [w["pid"] for w in daemon.full_status()["workers"]] == standby_pids
    assert process_state(standby_pids[0]) != "T" and after["standby"]["stopped"] != standby_pids
    # back at the normal policy, as the engine core the fork server forked for this generation
    cores = children({forkserver})
    assert cores and {p: thread_policies(p) for p in [*standby_pids, *cores]} == {
        p: {os.SCHED_OTHER} for p in [*standby_pids, *cores]}
    # and its KV cache is that reserve, not a second GiB faulted in on the recovery's path: the
    # worker says so in its Ray log, where an operator reads it, and did not grow by another GiB
    assert "KV cache allocated from the standby's reserve" in worker_log(standby_pids[0], "standby's reserve")
    # woken by the claim's connection, not by its park's end with the build's first call waiting behind it
    log = daemon.log_path.read_text(errors="replace")
    adopted = [line for line in log.splitlines() if f"(pid {standby_pids[0]}) for rank 0" in line]
    assert adopted and re.search(r"parked \d+ time\(s\), woken by a connection", adopted[-1]), adopted
    assert "could not wake a parked standby worker" not in log
    grown = rss_bytes(standby_pids[0]) - reserved_rss
    assert grown < GiB / 2, f"the adopted worker grew by {grown / GiB:.2f} GiB: its KV cache was allocated again"
    assert after["standby"]["adoptions"]["adopted"] >= 1
    # and a new standby is prepared for the generation after it
    s2 = daemon.wait_standby(for_generation=gen + 2)
    assert set(w["pid"] for w in s2["standby"]["workers"]).isdisjoint(standby_pids)
    # resting in its turn: the new worker and the fork server, not the engine core it forked
    assert s2["standby"]["resting"] == sorted([*(w["pid"] for w in s2["standby"]["workers"]), forkserver])
    assert s2["standby"]["stopped"] == [w["pid"] for w in s2["standby"]["workers"]]
    assert {p: thread_policies(p) for p in cores} == {p: {os.SCHED_OTHER} for p in cores}
    metrics = httpx.get(daemon.base_url + "/metrics/supervisor").text
    assert 'vllm_supervisor_standby_state{state="ready"} 1.0' in metrics
    print(f"\nengine_start with the standby: {rec['phases_s']['engine_start']:.1f} s, phases {rec['phases_s']}")


def test_no_child_holds_the_daemons_sockets_or_the_reapers_pipe(tp1, ray_head):
    """After a recovery, the engine core (forked by the fork server), the fork server and the
    Ray agent hold none of the daemon's sockets (HTTP and control listeners, the loop's signal
    wake-up socket) nor the write end of the crash reaper's pipe (``supervisor.children``)."""
    from chaos.leaks import cmdline, inherited
    from executor.reaper import descendants

    daemon, _ = tp1
    s = daemon.wait_standby()
    children = sorted(pid for pid, _ in descendants(daemon.proc.pid))
    names = {pid: cmdline(pid) for pid in children}
    reapers = [pid for pid, c in names.items() if "executor.reaper" in c]
    assert len(reapers) == 1, names
    assert s["standby"]["forkserver_pid"] in children, names
    assert any("EngineCore" in c for c in names.values()), names
    assert inherited(daemon.proc.pid, children, reaper=reapers[0]) == {}


def test_killed_standby_is_replaced_without_a_recovery(tp1, ray_head):
    daemon, ref = tp1
    s = daemon.wait_standby()
    gen, recoveries = s["generation"], len(s["recoveries"])
    replaced = s["standby"]["replacements"]
    old_pids = [w["pid"] for w in s["standby"]["workers"]]
    assert s["standby"]["watch"] == "exits", s["standby"]  # on this host: its exit is waited on, not polled
    killed = inject.kill_worker(ray_head.address, standby=True)
    assert killed["killed"].endswith(f"-g{gen + 1}"), killed
    s = daemon.wait_standby(replacements=replaced + 1)
    assert s["generation"] == gen and s["state"] == "ready" and len(s["recoveries"]) == recoveries
    new_pids = [w["pid"] for w in s["standby"]["workers"]]
    assert new_pids and set(new_pids).isdisjoint(old_pids)
    # serving was never touched, and the replacement is what the next recovery adopts
    records, _ = asyncio.run(run_with_fault(daemon.base_url, 4, MAX_TOKENS, lambda: inject.kill_worker(ray_head.address, rank=0)))
    exact(records, ref)
    after = daemon.wait_generation(gen + 1)
    assert after["recoveries"][-1]["standby"]["result"] == "adopted"
    assert [w["pid"] for w in daemon.full_status()["workers"]] == new_pids


def test_fork_server_death_is_an_engine_core_death_and_the_server_is_replaced(tp1, ray_head):
    """The fork server is the serving engine core's parent: its death is seen as the engine
    core's death. Streams continue exactly; the engine core it forked is killed at teardown;
    a new fork server is started."""
    import os
    import signal

    daemon, ref = tp1
    s = daemon.wait_standby()
    gen, server = s["generation"], s["standby"]["forkserver_pid"]
    assert server
    from executor.reaper import descendants, process_table

    # (pid, start time) of what it forked (the serving engine core once a recovery adopted the
    # standby; the module's earlier tests made one): found later even if orphaned to init
    forked = descendants(server)
    records, _ = asyncio.run(run_with_fault(daemon.base_url, 4, MAX_TOKENS, lambda: os.kill(server, signal.SIGKILL) or {}))
    exact(records, ref)
    s = daemon.wait_generation(gen + 1)
    assert s["recoveries"][-1]["ok"]
    s = daemon.wait_standby(for_generation=s["generation"] + 1)
    assert s["standby"]["forkserver_pid"] not in (None, server)
    # nothing the dead server forked is still running, wherever it was re-parented
    table = process_table()
    alive = {(pid, st) for pid, st in forked if table.get(pid, (0, None))[1] == st}
    assert not alive, f"still running after the fork server died: {alive}"
    from chaos.inject import engine_core_pids

    assert len(engine_core_pids(daemon.proc.pid)) == 1


def supervisor_metric(daemon, series: str) -> float:
    """One series of ``/metrics/supervisor`` (it exists from start-up)."""
    metrics = httpx.get(daemon.base_url + "/metrics/supervisor").text
    values = [float(line[len(series) + 1:]) for line in metrics.splitlines() if line.startswith(series + " ")]
    assert len(values) == 1, series
    return values[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="the starvation injector's busy processes at nice -20 need root, as in CI")
def test_a_starved_worker_is_not_judged_hung(tp1, ray_head):
    """The host keeps the serving worker off its core for 8 s, longer than ``hang_timeout_s``
    (4 s), its threads runnable all along (``chaos.starve``, the worker bound to one core
    meanwhile: what a second engine or a batch job on the worker's cores does). That is no hang: the verdict waits
    (``hang_starved_grace_s``), the engine is not rebuilt, and the streams finish on it with the
    text of a fault-free run; the time is on ``vllm_supervisor_engine_starved_seconds_total``."""
    from chaos.starve import starve

    daemon, ref = tp1
    s = daemon.wait_standby()
    gen = s["generation"]
    worker = daemon.full_status()["workers"][0]["pid"]
    starved = 'vllm_supervisor_engine_starved_seconds_total{replica="0"}'
    hangs = 'vllm_supervisor_restarts_total{reason="hang",replica="0"}'
    starved_before, hangs_before = supervisor_metric(daemon, starved), supervisor_metric(daemon, hangs)
    # The stall the verdict needs: the daemon's hang_timeout_s (4 s), then up to a check's period and the
    # confirmation's re-read. The kernel may still let the starved worker step once before that
    # (a fresh clone, 2026-12-05: the streams' largest gap 4.02 s, so no stall was confirmed and
    # nothing counted): an injector's miss, not the daemon's, so the starvation is tried again.
    from health.probe import CONFIRM_S, STALL_CHECK_S

    needed = FAST_PROBES["hang_timeout_s"] + STALL_CHECK_S + CONFIRM_S
    for _attempt in range(3):
        records, info = asyncio.run(run_with_fault(daemon.base_url, 4, MAX_TOKENS, lambda: starve(worker, 8.0, bind=True)))
        exact(records, ref)
        gap = max(b - a for r in records for a, b in zip(r.chunk_times, r.chunk_times[1:]))
        if gap > needed or daemon.status()["generation"] != gen:  # a wrong verdict is told below
            break
    after = daemon.status()
    # on failure: the injector's result, and the probe's lines (the engine's processes it reads,
    # its starvation sightings, a hang's detail with what it read of the engine's threads)
    said = [line for line in daemon.tail(2000).splitlines()
            if any(k in line for k in ("engine's processes", "could not list", "starv", "probe failed"))]
    assert after["generation"] == gen, "\n".join([str(after["recoveries"][-1:]), str(info), *said[-8:]])
    assert supervisor_metric(daemon, hangs) == hangs_before
    assert gap > needed, f"the streams' largest gap was {gap:.2f} s: the worker was not starved past {needed:.1f} s in 3 tries"
    # seen starved from the stall's confirmation (4.2 s in; its 0.2 s counted) until the engine
    # steps again, a check's period at a time. That is the kernel's to say: a starved thread
    # still gets a moment now and then (seen: 11 ms, 3.2 s in), and the engine may step on
    # (CI, 2026-11-29: again 4.95 s into an 8 s starvation, one sighting counted).
    assert supervisor_metric(daemon, starved) - starved_before > 0, "\n".join([str(info), f"gap {gap:.2f} s", *said[-8:]])
    assert "engine starved of CPU: its hang verdict waits" in daemon.tail(300)
    # said at the probe's next stall check after the engine's next step (every 0.5 s), which can
    # come after the streams' last token reached the client (CI, 2026-11-29: 0.3 s after the checks)
    deadline = time.monotonic() + 10
    while "engine moved again after starving" not in daemon.tail(300):
        assert time.monotonic() < deadline, daemon.tail()
        time.sleep(0.2)


def test_kill_with_arrivals_during_recovery(tp1, ray_head):
    """Five requests that arrive while the daemon is RECOVERING: two wait in the admission
    queue (``admission_queue_size`` 2) and are served exactly on the new engine, three get a
    503 that says so; the six streams the kill cut continue exactly."""
    daemon, ref = tp1
    s = daemon.wait_standby()
    before, continued = s["generation"], s["requests"].get("continued", 0)  # no key before a first continuation
    # The standby is adopted, so the daemon is RECOVERING for well under a second (0.6 s here):
    # the arrivals' thread is up before the kill, and sends the moment RECOVERING is seen.
    go, result = threading.Event(), {}

    def arrive():
        go.wait(120)
        result.update(r=asyncio.run(_batch(daemon, 5, None, offset=3)))

    thread = threading.Thread(target=arrive)
    thread.start()

    def kill_then_send_more():
        info = inject.kill_worker(ray_head.address, rank=0)
        wait_state(daemon, "recovering", timeout_s=10, poll_s=0.01)
        go.set()
        return info

    try:
        records, _ = asyncio.run(_batch(daemon, 6, kill_then_send_more))
    finally:
        go.set()
        thread.join(300)
    assert_all_exact(records, ref)
    late = result["r"][0]
    served = [r for r in late if r.outcome == "ok"]
    rejected = [r for r in late if r.outcome != "ok"]
    assert len(served) == 2 and len(rejected) == 3, [(r.outcome, r.status, r.error[:80]) for r in late]
    assert all(r.status == 503 and "admission queue is full" in r.error for r in rejected)
    assert compare(served, ref)["mismatched"] == 0
    assert_clean_generation(daemon, ray_head, before)
    assert daemon.status()["requests"]["continued"] >= continued + 6


def test_stop_with_a_standby_leaves_nothing(tp1, ray_head):
    daemon, _ = tp1
    daemon.wait_standby()
    stop_leaves_nothing(daemon, ray_head)
