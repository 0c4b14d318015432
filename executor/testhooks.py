"""The executor's deterministic fault points for the chaos tier; inert unless the daemon is
started with ``VLLM_SUPERVISOR_TEST_HOOKS=1`` (the same switch as ``supervisor.testhooks``,
which builds on this module: layers point down).

Which report of a worker death comes first (``executor.ray_cgraph``, the compiled-graph
executor): while its last step carried a client request, the GCS actor-table poller and the
shutdown's late check do not report, so only the failed step itself (with PP, its future's
``result()``) can; while idle (the last step held only the supervisor's ``probe-`` canaries),
a failed step waits up to ``IDLE_STEP_REPORT_HOLD_S`` for the poller's report first.

A query of death (``executor.ray_v2``'s worker): a worker dies at the step that a request marked
``supervisor_test_poison`` enters (``poisoned``).
"""

from __future__ import annotations

import os

ENV = "VLLM_SUPERVISOR_TEST_HOOKS"
IDLE_STEP_REPORT_HOLD_S = 5.0
POISON = "supervisor_test_poison"


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def poisoned(scheduler_output: object) -> bool:
    """Whether a request sent with ``vllm_xargs={"supervisor_test_poison": 1}`` enters the batch
    in this step: the worker then dies, as if the input crashed it (a query of death, for
    ``supervisor.suspects``). The daemon's environment reaches the Ray workers (vLLM copies its
    ``VLLM_*`` variables), so the switch is the same."""
    for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
        if (getattr(req.sampling_params, "extra_args", None) or {}).get(POISON):
            return True
    return False
