"""The executor's deterministic fault points for the chaos tier; inert unless the daemon is
started with ``VLLM_SUPERVISOR_TEST_HOOKS=1`` (the same switch as ``supervisor.testhooks``,
which builds on this module: layers point down).

Which report of a worker death comes first (``executor.ray_cgraph``, the compiled-graph
executor): while its last step carried a client request, the GCS actor-table poller and the
shutdown's late check do not report, so only the failed step itself (with PP, its future's
``result()``) can; while idle (the last step held only the supervisor's ``probe-`` canaries),
a failed step waits up to ``IDLE_STEP_REPORT_HOLD_S`` for the poller's report first.
"""

from __future__ import annotations

import os

ENV = "VLLM_SUPERVISOR_TEST_HOOKS"
IDLE_STEP_REPORT_HOLD_S = 5.0


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"
