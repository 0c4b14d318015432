"""Liveness, readiness and (later) metrics and systemd notification."""
