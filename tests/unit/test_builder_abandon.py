"""``EngineBuilder.abandon_builds``: the stop kills the engine core a build under way started,
and only that one; a build that has not started yet does not start. Real child processes carry
vLLM's engine-core title (``exec -a``) and stand in for engine cores."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from executor.engine import engine_cores_under
from executor.procfs import running
from supervisor.builder import BuildAbandoned, EngineBuilder


class NoCluster:
    cluster = None


def builder() -> EngineBuilder:
    return EngineBuilder(settings=None, engine_args=None, daemon_id="d", event_endpoint="", ray=NoCluster())


def engine_core() -> subprocess.Popen:
    """A child whose command line is vLLM's engine-core process title."""
    return subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 60"])


@pytest.fixture()
def cores():
    made: list[subprocess.Popen] = []
    yield made
    for proc in made:
        proc.kill()
        proc.wait()


def gone(proc: subprocess.Popen, timeout_s: float = 5.0) -> bool:
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def started(proc: subprocess.Popen) -> subprocess.Popen:
    import os

    deadline = time.monotonic() + 5
    while proc.pid not in engine_cores_under(os.getpid()):  # exec'd under its title
        assert time.monotonic() < deadline, "the stand-in never took vLLM's title"
        time.sleep(0.01)
    return proc


def test_only_the_engine_core_started_since_the_build_began_is_killed(cores):
    """Another replica's engine core (there before the build began) is left alone, and one
    the build starts after the abandon began is killed too."""
    import os

    b = builder()
    serving = started(engine_core())
    cores.append(serving)
    with b._building:  # the build under way, as ``build`` holds it
        b._cores_at_build_start = engine_cores_under(os.getpid())
        abandon = threading.Thread(target=lambda: killed.extend(b.abandon_builds(wait_s=10)))
        killed: list[int] = []
        abandon.start()
        time.sleep(0.5)  # vLLM starts the engine core only now
        late = started(engine_core())
        cores.append(late)
        assert gone(late), "the build's engine core was not killed"
        b._cores_at_build_start = None
    abandon.join(5)
    assert not abandon.is_alive() and killed == [late.pid]
    assert running(serving.pid)


def test_a_build_after_the_abandon_does_not_start():
    b = builder()
    assert b.abandon_builds(wait_s=1) == []  # no build under way: returns at once
    with pytest.raises(BuildAbandoned, match="the daemon is stopping"):
        b.build(7)
