"""The executor-side failure path: the event goes out once, before the engine's callback,
over a real pyzmq socket; the engine's callback always runs."""

import zmq

from executor.events import ADDITIONAL_CONFIG_KEY, WorkerDeathEvent
from executor.reporting import DeathReporter


class FakeVllmExecutor:
    """The slice of vLLM's executor the mixin relies on."""

    def __init__(self, endpoint):
        self.vllm_config = type("C", (), {"additional_config": {ADDITIONAL_CONFIG_KEY: {"generation": 4, "event_endpoint": endpoint}}})()
        self.failure_callback = None

    def register_failure_callback(self, callback):
        self.failure_callback = callback


class Executor(DeathReporter, FakeVllmExecutor):
    pass


def pull(tmp_path):
    sock = zmq.Context.instance().socket(zmq.PULL)
    endpoint = f"ipc://{tmp_path}/events.sock"
    sock.bind(endpoint)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    return sock, endpoint


def test_event_sent_once_before_the_engine_callback(tmp_path):
    """Called the way vLLM's monitor thread calls it: ``shutdown()`` (which records the dead
    ranks) and then the registered callback. The engine's callback itself checks that the
    event is already on the socket when it runs, and it must run exactly once."""
    sock, endpoint = pull(tmp_path)
    ex = Executor(endpoint)
    ex._wire()
    seen_by_engine_callback = []

    def engine_callback():
        # Sent before this callback runs: it arrives (zmq delivers in its I/O thread) even
        # though nothing more is sent while we wait here.
        if sock.poll(2000):
            seen_by_engine_callback.append(WorkerDeathEvent.from_json(sock.recv()))
        else:
            seen_by_engine_callback.append(None)

    ex.register_failure_callback(engine_callback)
    ex._record_death([(1, "vllm_Worker_x-g4_TP1", "node-a", "killed by `ray.kill`")])  # from shutdown()
    ex.failure_callback()  # the monitor thread then calls the (wrapped) engine callback
    assert len(seen_by_engine_callback) == 1
    event = seen_by_engine_callback[0]
    assert event is not None, "the engine's callback ran before the event was sent"
    assert (event.generation, event.ranks, event.actor_names, event.node_ids) == (4, [1], ["vllm_Worker_x-g4_TP1"], ["node-a"])
    assert event.cause == "killed by `ray.kill`"
    sock.setsockopt(zmq.RCVTIMEO, 200)
    try:
        sock.recv()
        raise AssertionError("the event was sent twice")
    except zmq.Again:
        pass
    sock.close(0)


def test_without_shutdown_the_callback_still_reports_first(tmp_path):
    """An executor failure that skips ``shutdown()``: the wrapped callback publishes before
    forwarding, so the engine's callback still finds the event already sent."""
    sock, endpoint = pull(tmp_path)
    ex = Executor(endpoint)
    ex._wire()
    order = []
    real_publish = ex._publish
    ex._publish = lambda: (order.append("publish"), real_publish())
    ex.register_failure_callback(lambda: order.append("engine"))
    ex.failure_callback()
    assert order == ["publish", "engine"]
    assert WorkerDeathEvent.from_json(sock.recv()).generation == 4
    sock.close(0)


def test_engine_callback_runs_even_if_reporting_fails(tmp_path):
    ex = Executor("ipc:///nonexistent/dir/x.sock")
    ex._wire()
    calls = []

    def failing_publish():
        calls.append("publish")
        raise RuntimeError("boom")

    ex._publish = failing_publish
    ex.register_failure_callback(lambda: calls.append("engine"))
    ex.failure_callback()
    assert calls == ["publish", "engine"]  # publishing was tried, failed, and the engine still heard


def test_without_identified_ranks_the_event_still_goes(tmp_path):
    sock, endpoint = pull(tmp_path)
    ex = Executor(endpoint)
    ex._wire()
    ex.register_failure_callback(lambda: None)
    ex.failure_callback()
    event = WorkerDeathEvent.from_json(sock.recv())
    assert event.ranks == [-1] and "no dead rank" in event.cause
    sock.close(0)
