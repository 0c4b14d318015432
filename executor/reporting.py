"""Worker-death reporting shared by our executors (runs in vLLM's engine-core process).

vLLM keeps one failure-callback slot per executor; the engine core fills it. We wrap what it
registers: first a typed ``WorkerDeathEvent`` goes to the supervisor, then the engine's own
callback runs (chained, never replaced). The monitor thread calls the executor's
``shutdown()`` before that callback; our override records the dead ranks there and sends the
event at once, because shutting the message queues down already makes the engine core fail
(and clients see ``EngineDeadError``) before the callback would run. It is sent once.
"""

from __future__ import annotations

import logging

from executor.events import WorkerDeathEvent, publish, wiring

# Under vLLM's logger tree: in the engine-core process vLLM's logging config (handler, level,
# the "(EngineCore pid=…)" prefix) applies to these lines too; a logger outside it prints
# warnings only.
logger = logging.getLogger("vllm.supervisor.executor")

CAUSE_MAX_CHARS = 2000
Dead = tuple[int, str, str, str]  # (rank, actor/process name, node id, cause)


class DeathReporter:
    """Mixin for a vLLM executor: ``_wire()`` in ``_init_executor``, ``_dead`` set by ``shutdown``."""

    _generation = 0
    _event_endpoint = ""
    _dead: list[Dead] = []

    _reported = False

    def _wire(self) -> None:
        wired = wiring(self.vllm_config)  # type: ignore[attr-defined]
        self._generation = int(wired.get("generation", 0))
        self._event_endpoint = wired.get("event_endpoint", "")
        self._dead = []
        self._reported = False

    def register_failure_callback(self, callback) -> None:  # type: ignore[override]
        def report_then_forward() -> None:
            try:
                self._report_death()
            finally:  # the engine's own callback runs regardless
                callback()

        super().register_failure_callback(report_then_forward)  # type: ignore[misc]

    def _record_death(self, dead: list[Dead]) -> None:
        """From the monitor thread's ``shutdown()``: remember the dead ranks and report now."""
        self._dead = dead
        self._report_death()

    def _report_death(self) -> None:
        """Send the ``WorkerDeathEvent`` (once per executor; never raises)."""
        if self._reported or not self._event_endpoint:
            return
        self._reported = True
        try:
            self._publish()
        except Exception:
            logger.exception("could not report worker death to the supervisor")

    def _late_dead(self) -> list[Dead]:
        """Dead ranks found when the failure is reported without a monitor record (another
        thread shut the executor down first); executors that can tell override this."""
        return []

    def _publish(self) -> None:
        dead = self._dead or self._late_dead() or [(-1, "", "", "executor failed (no dead rank identified)")]
        event = WorkerDeathEvent(
            generation=self._generation,
            ranks=[d[0] for d in dead],
            actor_names=[d[1] for d in dead],
            node_ids=[d[2] for d in dead],
            cause="; ".join(sorted({d[3] for d in dead})),
        )
        publish(self._event_endpoint, event)
        logger.error("generation %d: worker rank(s) %s died; supervisor notified", self._generation, event.ranks)
