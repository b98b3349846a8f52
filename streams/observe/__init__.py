"""Observability: Prometheus metrics, liveness and readiness, consumer lag, and reading a topic
back for checks. Stages and tools report here; nothing here decides anything for a request.
"""
