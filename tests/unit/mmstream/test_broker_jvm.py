"""The local broker's JVM options (`mmstream up`): its heap, and which compilers it runs: C1
only for the plaintext broker, both for the TLS one (docs/capacity.md, "The local broker's
compiler")."""

import pytest
from pydantic import ValidationError

from mmstream.localstack.kafka import C1_ONLY, LocalKafka, broker_jvm_options
from mmstream.localstack.secure import SecureKafka
from schemas.settings import Settings

def _local(**env: str):
    return Settings.from_env({f"MMSTREAM_LOCAL_{k.upper()}": v for k, v in env.items()}).local


def test_auto_runs_c1_only_where_no_tls_is_served() -> None:
    plain = broker_jvm_options(_local(kafka_heap_mb="300"), tls=LocalKafka.serves_tls)
    assert plain[:2] == ["-Xmx300m", "-Xms150m"] and C1_ONLY in plain and "-XX:+ExitOnOutOfMemoryError" in plain
    assert C1_ONLY not in broker_jvm_options(_local(), tls=SecureKafka.serves_tls)


def test_an_operator_can_choose_either_for_both_brokers() -> None:
    assert C1_ONLY in broker_jvm_options(_local(kafka_jit="c1"), tls=True)
    assert C1_ONLY not in broker_jvm_options(_local(kafka_jit="tiered"), tls=False)


def test_an_unknown_compiler_is_refused() -> None:
    with pytest.raises((ValidationError, ValueError)):
        Settings.from_env({"MMSTREAM_LOCAL_KAFKA_JIT": "c2"})
