"""The ready standby's threads, parked (the defaults since 2026-12-03) and not parked
(``daemon_without_park``): for each kind, a daemon on a Ray head of 2 CPUs, its standby ready, 5 s
of quiet, then every thread of the standby's Ray worker and of the fork server read from
``/proc/<pid>/task/<tid>`` over ``window`` seconds without a request (wake-ups a second, CPU ms a
second, by thread name), as ``bench/results/standby-idle-threads-2026-11-29/threads.py`` read them.

    PYTHONPATH=. .venv/bin/python bench/results/standby-parked-2026-12-03/threads.py [window_s] [kind ...]
"""

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "threads_1129", Path(__file__).parents[1] / "standby-idle-threads-2026-11-29" / "threads.py")
_before = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_before)


def measure(kind: str, window: float) -> None:
    with _before.settled_daemon(kind) as server:
        sampled = _before.sample(server, window)
    print(f"## {kind}, {window:.0f} s idle", flush=True)
    _before.report(*sampled, window)


def main() -> None:
    window = float(sys.argv[1]) if len(sys.argv) > 1 else 30.0
    for kind in sys.argv[2:] or ["daemon", "daemon_without_park"]:
        measure(kind, window)


if __name__ == "__main__":
    main()
