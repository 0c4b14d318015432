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
    sock, endpoint = pull(tmp_path)
    ex = Executor(endpoint)
    ex._wire()
    calls = []
    ex.register_failure_callback(lambda: calls.append("engine"))
    ex._record_death([(1, "vllm_Worker_x-g4_TP1", "node-a", "killed by `ray.kill`")])  # from shutdown()
    event = WorkerDeathEvent.from_json(sock.recv())
    assert (event.generation, event.ranks, event.actor_names, event.node_ids) == (4, [1], ["vllm_Worker_x-g4_TP1"], ["node-a"])
    ex.failure_callback()  # the monitor thread then calls the (wrapped) engine callback
    assert calls == ["engine"]
    sock.setsockopt(zmq.RCVTIMEO, 200)
    try:
        sock.recv()
        raise AssertionError("the event was sent twice")
    except zmq.Again:
        pass
    sock.close(0)


def test_engine_callback_runs_even_if_reporting_fails(tmp_path):
    ex = Executor("ipc:///nonexistent/dir/x.sock")
    ex._wire()
    ex._publish = lambda: (_ for _ in ()).throw(RuntimeError("boom"))
    calls = []
    ex.register_failure_callback(lambda: calls.append("engine"))
    ex.failure_callback()
    assert calls == ["engine"]


def test_without_identified_ranks_the_event_still_goes(tmp_path):
    sock, endpoint = pull(tmp_path)
    ex = Executor(endpoint)
    ex._wire()
    ex.register_failure_callback(lambda: None)
    ex.failure_callback()
    event = WorkerDeathEvent.from_json(sock.recv())
    assert event.ranks == [-1] and "no dead rank" in event.cause
    sock.close(0)
