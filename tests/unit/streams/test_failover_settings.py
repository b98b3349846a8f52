"""Failover sizing: what the stage's clients and the local brokers are told, so a fault costs
seconds (docs/reliability.md, "Failover: where the seconds go")."""

from mmstream.localstack.kafka import FAILOVER_PROPERTIES, failover_lines
from schemas.settings import Settings
from streams.runtime import io
from streams.runtime.io import IOSettings


def test_the_rebalance_timeout_covers_a_session_the_revoke_drain_and_its_commit() -> None:
    s = IOSettings("127.0.0.1:1", "g", {}, session_timeout_ms=3000, revoke_drain_s=5.0, commit_timeout_s=5.0)
    assert s.rebalance_timeout_ms == 13000
    assert s.fence_margin_s == 1.0  # the lease: two thirds of the session


def test_output_retries_are_bounded_near_a_second() -> None:
    assert io.RETRY_MAX_S <= 1.0 and io.RETRY_BASE_S <= 0.1


def test_default_sessions_are_ones_every_stock_broker_accepts() -> None:
    k = Settings.from_env({}).kafka
    assert k.session_timeout_ms == 6000  # a stock broker's group.min.session.timeout.ms
    assert k.heartbeat_interval_ms * 3 <= k.session_timeout_ms


def test_local_and_chaos_brokers_accept_short_sessions_and_fence_dead_brokers_fast() -> None:
    assert int(FAILOVER_PROPERTIES["group.min.session.timeout.ms"]) <= 3000
    assert int(FAILOVER_PROPERTIES["broker.session.timeout.ms"]) <= 3000
    lines = failover_lines()
    assert lines.startswith("\n") and "broker.heartbeat.interval.ms=500\n" in lines
