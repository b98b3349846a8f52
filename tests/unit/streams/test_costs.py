from streams.costs import CostObserver


def test_observer_follows_service_time_per_unit():
    o = CostObserver(alpha=0.5)
    o.observe(units=10, service_ms=20)
    assert o.ms_per_unit == 2.0
    o.observe(units=10, service_ms=40)
    assert o.ms_per_unit == 3.0
    o.observe(units=0, service_ms=5)  # nothing learned from an empty batch
    assert o.ms_per_unit == 3.0
