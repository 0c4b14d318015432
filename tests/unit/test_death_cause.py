"""Ray's death-cause texts (as seen from the daemon's logs) fall in the right category."""

import pytest

from health.metrics import death_cause

ACTOR_DIED = ("ActorDiedError: The actor died unexpectedly before finishing this task.\n\tclass_name: "
              "SupervisedRayWorkerProc\n\tpid: 25531\n\tip: 192.0.2.2\n")


@pytest.mark.parametrize("text, cause", [
    (ACTOR_DIED + "The actor is dead because it was killed by `ray.kill`.", "killed"),
    (ACTOR_DIED + "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker "
     "exit detail: Worker unexpectedly exits with a connection error code 2. End of file. There are some potential "
     "root causes. (1) The process is killed by SIGKILL by OOM killer due to high memory usage. (2) ray stop --force "
     "is called. (3) The worker is crashed unexpectedly due to SIGSEGV or other unexpected errors.", "exited"),
    (ACTOR_DIED + "The actor died because its node has died. Node Id: 65e21fcb\n\tthe actor's node was terminated "
     "expectedly: received SIGTERM", "node_lost"),
    (ACTOR_DIED + "The actor is dead because its worker process was killed by the memory monitor: the node was "
     "running low on memory.", "oom"),
    ("worker process 1234 exited with -9", "exited"),
    ("executor failed (no dead rank identified)", "unknown"),
])
def test_death_cause(text, cause):
    assert death_cause(text) == cause
