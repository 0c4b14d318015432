# Measurement only: in a server's front (a session leader), record every GC collection's time.
import os
if os.getpid() == os.getsid(0) and os.environ.get("GCPROBE_DIR"):
    import gc, json, time, atexit, sys
    _d = os.environ["GCPROBE_DIR"]
    _ev = []
    _t = [0.0, time.monotonic()]
    def _write():
        with open(f"{_d}/{os.getpid()}.json", "w") as f:
            json.dump({"argv": " ".join(sys.argv)[:200], "events": _ev, "frozen": gc.get_freeze_count(),
                       "objects": len(gc.get_objects())}, f)
    def _cb(phase, info):
        if phase == "start":
            _t[0] = time.perf_counter()
            return
        _ev.append((time.time(), info["generation"], time.perf_counter() - _t[0]))
        now = time.monotonic()
        if now - _t[1] > 5:
            _t[1] = now
            _write()
    gc.callbacks.append(_cb)
    atexit.register(_write)
