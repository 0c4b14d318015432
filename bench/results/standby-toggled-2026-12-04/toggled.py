"""What the ready standby's running costs one daemon at saturation, measured within that daemon
(issue 42, 2026-12-04, afternoon).

Between servers started one after the other, this host's two states (its gauge's Python loop at
0.8-1.0 or 1.2-1.5 ms, every process's CPU per token 30-40 % apart) decide a round more than the
standby does: ``bench.pooled --same-state`` keeps the rounds whose windows ran in one state, and
those are too few to resolve 5 %. Here one daemon with its defaults is started, warmed and left
idle ``SETTLE_S``, then measured in blocks of three back-to-back windows, each as
``bench.serving_overhead --saturation`` measures one (400 prompts, 8 streams, 32 in / 64 out, the
client at niceness -10):

* ``as_is``: the ready standby as the daemon leaves it (its worker parked, the engine core's fork
  server waiting);
* ``frozen``: every process of the standby stopped (SIGSTOP) over the window: nothing of it runs;
* ``sched_idle``: every thread of the standby under Linux's ``SCHED_IDLE`` over the window, and
  back to ``SCHED_OTHER`` after it: it runs only on a core nothing else wants, and its wake-ups
  never preempt a serving thread (niceness 15 still lets a waking thread preempt one).

The order of the three turns every block (a Latin square), so the host's drift within a block
falls on each alike. Each block's ``frozen`` and ``sched_idle`` windows are divided by its
``as_is``; the summary gives the median ratio over every block and over the blocks whose windows
ran in one host state (the gauge within 10 %). Root, or the daemon's owner for the first two;
``SCHED_OTHER`` back from ``SCHED_IDLE`` needs ``CAP_SYS_NICE``. The probe changes nothing in the
daemon, and checks after each window that the standby is still ready with the same pids.

    PYTHONPATH=. .venv/bin/python bench/results/standby-toggled-2026-12-04/toggled.py DAEMONS BLOCKS [MODE ...]

The modes after ``BLOCKS`` replace ``frozen sched_idle``; ``sched_batch`` is a third:
``SCHED_BATCH``, which an unprivileged owner can set and take back, and whose wake-ups do not
preempt a serving thread either (it keeps its share of a core). Since the daemon rests its ready
standby under ``SCHED_IDLE`` itself (``supervisor.standby_sched``), ``as_is`` is that, each window
sets the standby back to the policy the daemon left, and ``sched_other`` is the standby as it
waited before: at the normal policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.serving_overhead import SaturationLoad, measure, report, standby_pids, stopped, warm_rounds
from supervisor import standby_sched

KEYS = ("output_throughput", "cpu_ms_per_token", "p50_ttft_ms", "p50_itl_ms", "ttft_prefill_ms", "step_ms")
SAME_STATE = 0.1


class Load(SaturationLoad):
    settle_s = float(os.environ.get("SETTLE_S", "60"))


def threads(pids: list[int]) -> list[int]:
    return [tid for pid in pids for tid in standby_sched.threads(pid)]


@contextlib.contextmanager
def sched_policy(pids: list[int], policy: int, back: int) -> Iterator[list[int]]:
    """Every thread of ``pids`` under ``policy`` for the block, back to ``back`` after it
    however it ends (threads started meanwhile inherit the policy and are set back too)."""
    for tid in threads(pids):
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    try:
        yield pids
    finally:
        for tid in threads(pids):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setscheduler(tid, back, os.sched_param(0))


def policies(pids: list[int]) -> set[int]:
    return {os.sched_getscheduler(t) for t in threads(pids)}


POLICIES = {"sched_idle": os.SCHED_IDLE, "sched_batch": os.SCHED_BATCH, "sched_other": os.SCHED_OTHER}


def window(mode: str, pids: list[int], back: int):
    if mode in POLICIES:
        return sched_policy(pids, POLICIES[mode], back)
    return stopped(pids) if mode == "frozen" else contextlib.nullcontext()


def same_state(a: dict, b: dict) -> bool:
    x, y = a.get("host_python_ms"), b.get("host_python_ms")
    return bool(x and y) and 1 / (1 + SAME_STATE) <= x / y <= 1 + SAME_STATE


def summary(blocks: list[dict[str, dict]], modes: tuple[str, ...]) -> None:
    print(f"\n{len(blocks)} blocks; median ratio to as_is (min-max), all blocks | blocks in one host state:")
    for mode in modes[1:]:
        same = [b for b in blocks if same_state(b[mode], b["as_is"])]
        cells = []
        for key in KEYS:
            def ratios(bs):
                return [b[mode][key] / b["as_is"][key] for b in bs if b[mode].get(key) and b["as_is"].get(key)]
            every, one = ratios(blocks), ratios(same)
            lower = sum(r < 1 for r in every)
            cells.append(f"{key} {statistics.median(every):.3f} ({min(every):.3f}-{max(every):.3f}, lower in {lower}/{len(every)})"
                         + (f" | {statistics.median(one):.3f} ({len(one)})" if one else " | none"))
        print(f"  {mode}:\n    " + "\n    ".join(cells))


def main() -> None:
    daemons = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    per_daemon = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    modes = ("as_is", *(sys.argv[3:] or ("frozen", "sched_idle")))
    assert set(modes[1:]) <= {"frozen", *POLICIES}, modes
    blocks: list[dict[str, dict]] = []
    for d, _kind, server, work, head in warm_rounds(["daemon"], daemons, "standby-toggled-", Load):
        pids = standby_pids(server)
        assert len(pids) >= 2, f"no standby to toggle: {server.status()['standby']}"
        (back,) = policies(pids)  # as the daemon left it: SCHED_IDLE since 2026-12-04 (standby_sched)
        for b in range(per_daemon):
            order = modes[(b % len(modes)):] + modes[:(b % len(modes))]
            block = {}
            for mode in order:
                name = f"d{d}-b{b}-{mode}"
                (work / name).mkdir()
                with window(mode, pids, back):
                    if mode in POLICIES:
                        assert policies(pids) == {POLICIES[mode]}, policies(pids)
                    block[mode] = report(len(blocks), mode, measure(server, work / name, name, head, Load))
                assert standby_pids(server) == pids and server.status()["standby"]["state"] == "ready", server.status()["standby"]
                assert policies(pids) == {back}, policies(pids)
            blocks.append(block)
            print(f"  block {len(blocks)} ({' '.join(order)}): prefill ms "
                  + ", ".join(f"{m} {block[m]['ttft_prefill_ms']:.2f}" for m in modes)
                  + "; gauge " + ", ".join(f"{block[m]['host_python_ms']:.3f}" for m in modes), flush=True)
    summary(blocks, modes)
    Path(__file__).with_name(f"blocks-{'-'.join(modes[1:])}.json").write_text(json.dumps([{m: {k: v for k, v in w.items() if isinstance(v, (int, float, str)) or v is None}
                 for m, w in block.items()} for block in blocks], indent=1))


if __name__ == "__main__":
    main()
