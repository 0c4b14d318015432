"""Prometheus metrics of the supervisor (prefix ``vllm_supervisor_``, base units).

Every series exists from the first scrape: labelled families are initialised with all
their label values. Each series about one engine (its generation, workers, deaths, restarts,
recoveries, probe) carries a ``replica`` label (``--replicas``; "0" with one replica). They live in a registry of their own: ``/metrics`` serves it after
prometheus-client's default registry (vLLM's own ``vllm:*`` series, which each new engine
re-registers, and the process collectors), as ``vllm serve``'s ``/metrics`` does;
``/metrics/supervisor`` serves it alone, clean for ``promtool check metrics`` (vLLM's
names contain ``:``, which promtool's linter rejects).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from health.loop_histogram import LoopHistogram

PREFIX = "vllm_supervisor_"
STATES = ("starting", "ready", "recovering", "draining", "stopping", "stopped", "failed")
DEATH_CAUSES = ("killed", "exited", "oom", "node_lost", "unknown")
RESTART_REASONS = ("worker_death", "engine_dead", "hang", "ray_lost", "build_failed", "operator", "reload")
PHASES = ("detect", "drain", "teardown", "ray_reconnect", "placement_group", "engine_start")
OUTCOMES = ("ok", "continued", "rejected", "failed")

# LLM serving: first tokens in tens of ms to tens of s; recoveries in s to minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
RECOVERY_BUCKETS = (1, 2.5, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
PHASE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def death_cause(text: str) -> str:
    """Coarse category of Ray's death-cause text. Ray appends a list of "potential root
    causes" to some messages ("killed by SIGKILL by OOM killer", "ray stop --force", …), so
    its definite statements are matched first."""
    t = text.lower()
    if "killed by `ray.kill`" in t or "ray.kill" in t:
        return "killed"
    if "node has died" in t or "node was terminated" in t or ("node" in t and "removed" in t):
        return "node_lost"
    if "out of memory" in t or "low on memory" in t or "memory monitor" in t:
        return "oom"
    if "exit" in t or "sigkill" in t or "terminated" in t or "died unexpectedly" in t:
        return "exited"
    return "unknown"


def supervisor_registry() -> CollectorRegistry:
    """Our own registry. The process/platform/GC collectors stay in the default registry,
    which ``/metrics`` serves beside this one (a series must appear once)."""
    return CollectorRegistry()


STANDBY_STATES = ("off", "preparing", "ready", "adopting", "unavailable")  # supervisor.standby.StandbyState


class SupervisorMetrics:
    def __init__(self, world_size: int, registry: CollectorRegistry | None = None):
        p = PREFIX
        self.registry = r = registry if registry is not None else supervisor_registry()
        self.state = Gauge(p + "state", "1 for the daemon's current lifecycle state, else 0", ["state"], registry=r)
        self.replica_up = Gauge(p + "replica_up", "1 while this engine replica serves", ["replica"], registry=r)
        self.replica_budget_spent = Gauge(
            p + "replica_restart_budget_spent",
            "1 while this replica's restart budget is spent and it waits to retry (the others serve)", ["replica"],
            registry=r)
        self.generation = Gauge(p + "engine_generation", "Number of the engine generation this replica serves (0: none)",
                                ["replica"], registry=r)
        self.worker_up = Gauge(p + "worker_up", "1 while the worker actor of this rank serves", ["replica", "rank"], registry=r)
        self.worker_deaths = Counter(p + "worker_deaths", "Worker actor deaths by cause", ["replica", "cause"], registry=r)
        self.restarts = Counter(p + "restarts", "Engine re-creations by reason", ["replica", "reason"], registry=r)
        self.recovery_duration = Histogram(p + "recovery_duration_seconds", "Failure detected to new engine READY",
                                           ["replica"], buckets=RECOVERY_BUCKETS, registry=r)
        self.recovery_phase = Histogram(p + "recovery_phase_duration_seconds", "Duration of each recovery phase",
                                        ["replica", "phase"], buckets=PHASE_BUCKETS, registry=r)
        self.requests = Counter(p + "requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.quarantined = Counter(p + "requests_quarantined", "Requests that crashed two engines (a query of death), "
                                   "their input refused from then on", registry=r)
        self.in_flight = Gauge(p + "requests_in_flight", "Requests being served, parked or queued", registry=r)
        self.parked = Gauge(p + "requests_parked", "In-flight requests waiting for the next engine", registry=r)
        self.queue_depth = Gauge(p + "admission_queue_depth", "New requests waiting for an engine", registry=r)
        # observed on the event loop, per request or per output: plain bucket counts read at
        # scrape (health.loop_histogram), the same series as prometheus-client's Histogram
        self.ttft = LoopHistogram(p + "time_to_first_token_seconds", "Request arrival to first token", buckets=TTFT_BUCKETS, registry=r)
        self.itl = LoopHistogram(p + "inter_token_latency_seconds", "Time between tokens of a stream", buckets=ITL_BUCKETS, registry=r)
        self.e2e = LoopHistogram(p + "request_duration_seconds", "Request arrival to last token", buckets=E2E_BUCKETS, registry=r)
        self.probe_latency = Histogram(p + "probe_duration_seconds", "Duration of the canary generation", ["replica"],
                                       buckets=PROBE_BUCKETS, registry=r)
        self.starved_seconds = Counter(
            p + "engine_starved_seconds", "Time a busy engine took no step while its threads waited for a CPU "
            "(starved by the host: its hang verdict waits up to hang_starved_grace_s)", ["replica"], registry=r)
        self.probe_last_success = Gauge(p + "probe_last_success_timestamp_seconds", "Unix time of the last successful probe",
                                        ["replica"], registry=r)
        self.ray_connected = Gauge(p + "ray_connected", "1 while the daemon's Ray agent is connected to the cluster's GCS "
                                   "(0 from a lost GCS until it is back)", registry=r)
        self.standby_state = Gauge(p + "standby_state", "1 for the warm standby's current state, else 0", ["state"], registry=r)
        self.standby_replacements = Counter(p + "standby_replacements", "Standby parts that died and were replaced", registry=r)
        self.standby_adoptions = Counter(p + "standby_adoptions", "Engine builds by whether their workers were adopted from the standby",
                                         ["result"], registry=r)
        for s in STATES:
            self.state.labels(s).set(1 if s == "starting" else 0)
        for result in ("adopted", "cold"):
            self.standby_adoptions.labels(result)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.world_size = world_size
        self.set_replicas(1)

    def set_replicas(self, n: int) -> None:
        """Create every per-replica series of replicas 0..n-1."""
        for i in map(str, range(n)):
            self.replica_up.labels(i).set(0)
            self.replica_budget_spent.labels(i).set(0)
            self.generation.labels(i).set(0)
            self.recovery_duration.labels(i)
            self.probe_latency.labels(i)
            self.starved_seconds.labels(i)
            self.probe_last_success.labels(i)
            for rank in range(self.world_size):
                self.worker_up.labels(i, str(rank)).set(0)
            for c in DEATH_CAUSES:
                self.worker_deaths.labels(i, c)
            for reason in RESTART_REASONS:
                self.restarts.labels(i, reason)
            for phase in PHASES:
                self.recovery_phase.labels(i, phase)

    def bind_gauges(self, in_flight: Callable[[], float], parked: Callable[[], float], queue: Callable[[], float]) -> None:
        self.in_flight.set_function(in_flight)
        self.parked.set_function(parked)
        self.queue_depth.set_function(queue)

    def set_state(self, state: str) -> None:
        for s in STATES:
            self.state.labels(s).set(1 if s == state else 0)

    def replica(self, index: int, up: bool, generation: int) -> None:
        self.replica_up.labels(str(index)).set(1 if up else 0)
        self.generation.labels(str(index)).set(generation)
        self.workers(index, up)

    def set_standby(self, state: str) -> None:
        for s in STANDBY_STATES:
            self.standby_state.labels(s).set(1 if s == state else 0)

    def workers(self, replica: int, up: bool, ranks: Iterable[int] | None = None) -> None:
        for rank in range(self.world_size) if ranks is None else ranks:
            if 0 <= rank < self.world_size:
                self.worker_up.labels(str(replica), str(rank)).set(1 if up else 0)

    def recovery(self, replica: int, total_s: float, phases: dict[str, float]) -> None:
        self.recovery_duration.labels(str(replica)).observe(total_s)
        for phase, seconds in phases.items():
            if phase in PHASES:
                self.recovery_phase.labels(str(replica), phase).observe(seconds)
