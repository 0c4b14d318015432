"""Loaded by every Python process the probe starts (``PYTHONPATH``), with ``GC_PROBE_DIR`` set:
the garbage collector's work by generation (collections, CPU and wall seconds, objects
collected), written once a second to ``GC_PROBE_DIR/<pid>.json``."""

import gc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("GC_PROBE_DIR")
if _DIR:
    _gens = {g: [0, 0.0, 0.0, 0] for g in range(3)}  # collections, CPU s, wall s, collected
    _began = [0.0, 0.0]

    def _callback(phase, info):
        if phase == "start":
            _began[0], _began[1] = time.thread_time(), time.perf_counter()
            return
        g = _gens[info["generation"]]
        g[0] += 1
        g[1] += time.thread_time() - _began[0]
        g[2] += time.perf_counter() - _began[1]
        g[3] += info.get("collected", 0)

    gc.callbacks.append(_callback)

    def _dump():
        path = os.path.join(_DIR, f"{os.getpid()}.json")
        while True:
            time.sleep(1.0)
            data = {"gens": _gens, "frozen": gc.get_freeze_count(), "thresholds": gc.get_threshold(), "argv": sys.argv[:4]}
            with open(path + ".tmp", "w") as fh:
                fh.write(json.dumps(data))
            os.replace(path + ".tmp", path)

    threading.Thread(target=_dump, daemon=True, name="gc-probe").start()
