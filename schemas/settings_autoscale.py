"""The autoscale section: how many replicas each stage's pool may have and when it gets another.

Read as ``MMSTREAM_AUTOSCALE_<NAME>``. The local scaler (`mmstream up --autoscale`) acts on
all of it; the KEDA ScaledObjects in infra/k8s are generated from ``pools`` and the lag
thresholds (``mmstream.k8s_scalers``), and a test holds the file equal to what these
defaults generate, so what runs locally is what runs on Kubernetes. What each decision
trades is in docs/autoscaling.md.
"""

from __future__ import annotations

from pydantic import field_validator

from schemas.settings_base import Section, parse_assignments, setting, whole_number

DEFAULT_POOLS = ("router=1:4,assembler=1:4,encode.text=1:8,encode.image=1:8,encode.audio=0:4,encode.video=0:4,"
                 "generate=0:8,retrieve=1:8")


def parse_pools(value: str) -> dict[str, tuple[int, int]]:
    """``encode.text=1:8,generate=0:2`` -> {stage: (min, max)}. Raises ``ValueError`` naming
    the bad item (not ``STAGE=MIN:MAX`` with 0 <= MIN <= MAX, MAX >= 1)."""
    return parse_assignments(value, _min_max, "STAGE=MIN:MAX with 0 <= MIN <= MAX and MAX >= 1")


def _min_max(spec: str) -> tuple[int, int]:
    low, colon, high = (x.strip() for x in spec.partition(":"))
    if not colon:
        raise ValueError(spec)
    low_n, high_n = whole_number(low), whole_number(high, least=1)
    if low_n > high_n:
        raise ValueError(spec)
    return low_n, high_n


class AutoscaleSettings(Section):
    pools: str = setting(
        DEFAULT_POOLS, "Replicas each scaled stage may have, STAGE=MIN:MAX. A MIN of 0 lets an idle pool scale to zero "
        "and wake on its first record (a cold start: docs/autoscaling.md). Stages not named keep what `up` started."
    )
    interval_s: float = setting(1.0, "How often the local scaler reads lag and load and decides.", gt=0.0, le=60.0)
    up_window_s: float = setting(
        2.0, "A pool grows only after every read of this window asked for more; it grows to the least any asked "
        "for (a burst shorter than this costs no replica).", ge=0.0
    )
    down_window_s: float = setting(
        30.0, "A pool shrinks only after every read of this window asked for less, to the most any asked for, and "
        "never sooner than this after its last change (the cooldown).", ge=0.0
    )
    idle_s: float = setting(
        60.0, "A pool whose MIN is 0 stops its last replica after this long with no lag and no queued work.", ge=0.0
    )
    target_queued_ms: float = setting(
        250.0, "Engine work (predicted ms, from the stages' load reports) one replica may hold before the pool asks "
        "for another: the local scaler's early signal, ahead of lag. KEDA sees lag only.", gt=0.0
    )
    rt_lag: int = setting(50, "Records of rt lag per replica before a pool asks for another (KEDA's lagThreshold).",
                          ge=1)
    bulk_lag: int = setting(200, "Records of bulk lag per replica before a pool asks for another.", ge=1)
    generate_rt_lag: int = setting(
        8, "The generate pool's rt lag per replica: a generate record is seconds of work, not milliseconds.", ge=1
    )
    generate_bulk_lag: int = setting(32, "The generate pool's bulk lag per replica.", ge=1)
    spare: bool = setting(
        True, "Keep one warm spare process (imports done, no stage yet) for the scaler to turn into the next "
        "replica: a cold start without its 0.9-1.7 s of imports, for about 150 MB of memory (mmstream.standby)."
    )
    cpu_cores: int = setting(
        0, "Cores the local scaler may fill with busy engine threads (0: the box's count). A replica beyond the first "
        "is started only while the busy pools' threads and its own fit: one more only fights for the same cores.",
        ge=0
    )

    @field_validator("pools")
    @classmethod
    def _pools(cls, value: str) -> str:
        parse_pools(value)
        return value

    def limits(self) -> dict[str, tuple[int, int]]:
        return parse_pools(self.pools)

    def lag_per_replica(self, stage: str, lane: str) -> int:
        if stage == "generate":
            return self.generate_rt_lag if lane == "rt" else self.generate_bulk_lag
        return self.rt_lag if lane == "rt" else self.bulk_lag
