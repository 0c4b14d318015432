"""Loaded by every Python process started with this directory on PYTHONPATH and FRONTPROF_OUT
set: SIGUSR1 starts cProfile in the main thread of the process that got it, the next SIGUSR1
stops it and writes the stats to $FRONTPROF_OUT.<pid>;
FRONTPROF_TIMER=thread profiles CPU time instead of wall time. The probe signals the front alone."""
import os
if os.environ.get("FRONTPROF_OUT"):
    import cProfile, signal
    _prof = [None]

    def _toggle(signum, frame):
        if _prof[0] is None:
            # FRONTPROF_TIMER=thread: the thread's CPU time (time.thread_time), not the wall clock,
            # so that time the thread was preempted or waited in the kernel is not counted
            import time
            timer = time.thread_time if os.environ.get("FRONTPROF_TIMER") == "thread" else None
            _prof[0] = cProfile.Profile(timer) if timer else cProfile.Profile()
            _prof[0].enable()
        else:
            _prof[0].disable()
            _prof[0].dump_stats(f"{os.environ['FRONTPROF_OUT']}.{os.getpid()}")
            _prof[0] = None

    try:
        signal.signal(signal.SIGUSR1, _toggle)
    except ValueError:  # not the main thread
        pass
