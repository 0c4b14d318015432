"""The leak check sees what it does not know: a process orphaned to init whatever its name, a
child, a ``/dev/shm`` entry of a new kind; and it spares what the caller keeps on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

from chaos.leaks import SHM, Leaks, processes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def orphan() -> int:
    """A process whose parent exits at once (a double fork): re-parented to init."""
    out = subprocess.run([sys.executable, "-c",
                          "import subprocess, sys; p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)",
                          *SLEEPER], capture_output=True, text=True, check=True)
    return int(out.stdout)


def test_an_orphan_a_child_and_a_new_segment_are_found_and_an_allowed_tree_is_not():
    leaks = Leaks()
    assert leaks.new() == {"processes": {}, "shm": []}
    lost = orphan()
    child = subprocess.Popen(SLEEPER)
    kept = subprocess.Popen(SLEEPER)
    segment = SHM / f"never-heard-of-{uuid.uuid4().hex}"
    segment.write_bytes(b"x")
    try:
        time.sleep(0.2)
        left = leaks.new(allow=lambda: [kept.pid])
        assert lost in left["processes"] and child.pid in left["processes"], left
        assert kept.pid not in left["processes"], left
        assert left["shm"] == [segment.name], left
        leaks.kill_new(allow=lambda: [kept.pid])
        child.wait(5)
        assert leaks.wait_clean(settle_s=5, allow=lambda: [kept.pid]) == {}
        assert kept.poll() is None and lost not in processes()  # killed (a zombie until init reaps it)
    finally:
        for p in (child, kept):
            p.kill()
            p.wait()
        segment.unlink(missing_ok=True)
        try:
            os.kill(lost, 9)
        except ProcessLookupError:
            pass
