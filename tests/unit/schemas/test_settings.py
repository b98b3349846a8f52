from pathlib import Path
from typing import get_args

import pytest
from pydantic import ValidationError

from schemas.settings import (ENGINE_PRECISIONS, EnginePrecision, KafkaSettings, Partitioner, Settings,
                              SettingsError, describe, env_names, redact)
from streams.policies.partitioning import STRATEGIES


def test_defaults_and_env_override():
    s = Settings.from_env({"MMSTREAM_KAFKA_BOOTSTRAP": "k:1", "MMSTREAM_KAFKA_PARTITIONS": "8",
                           "MMSTREAM_REDIS_URL": "redis://r:2/0"})
    assert s.kafka.bootstrap == "k:1" and s.kafka.partitions == 8 and s.redis.url == "redis://r:2/0"
    assert Settings.from_env({}).kafka.topic_prefix == "mm"


def test_bad_value_names_the_variable():
    with pytest.raises(SettingsError, match="MMSTREAM_KAFKA_PARTITIONS"):
        Settings.from_env({"MMSTREAM_KAFKA_PARTITIONS": "many"})


def test_every_setting_is_documented():
    rows = describe(Settings())
    assert rows and all(doc for _, _, doc in rows)


# -- validation at start ----------------------------------------------------------------

@pytest.mark.parametrize("var, value, says", [
    ("MMSTREAM_KAFKA_PARTITIONS", "-3", "greater than or equal to 1"),
    ("MMSTREAM_KAFKA_PARTITIONS", "0", "greater than or equal to 1"),
    ("MMSTREAM_ROUTER_PARTITIONER", "bogus", "least-loaded"),
    ("MMSTREAM_ENCODER_PRECISION", "fp8", "fp32"),
    ("MMSTREAM_GENERATOR_SCHEDULER", "dynamic", "continuous"),
    ("MMSTREAM_MODELS_AUDIO_PRECISION", "fp16", "int8"),
    ("MMSTREAM_CACHE_ENABLED", "maybe", "boolean"),
    ("MMSTREAM_KAFKA_BOOTSTRAP", "localhost", "host:port"),
    ("MMSTREAM_REDIS_URL", "localhost:6379", "redis"),
    ("MMSTREAM_METRICS_PORT", "70000", "65535"),
    ("MMSTREAM_ROUTER_SERVED_MODALITIES", "text,Smell!", "Smell!"),  # which names exist: the registry's
    ("MMSTREAM_VIDEO_FPS", "0", "greater than 0"),
    ("MMSTREAM_ROUTER_COLOCATE_NICE", "image=20", "nice 1-19"),
    ("MMSTREAM_ROUTER_COLOCATE_NICE", "image", "modality=nice"),
    ("MMSTREAM_LOCAL_NICE", "router=-21", "nice -20..19"),
    ("MMSTREAM_LOCAL_NICE", "router=high", "name=nice"),
])
def test_out_of_range_or_unknown_values_are_refused_naming_the_variable(var, value, says):
    with pytest.raises(SettingsError) as err:
        Settings.from_env({var: value})
    assert str(err.value).startswith(f"{var}={value!r}") and says in str(err.value)


def test_checks_across_fields_name_the_section():
    with pytest.raises(SettingsError, match="MMSTREAM_ADMISSION_.*backpressure_low_ms"):
        Settings.from_env({"MMSTREAM_ADMISSION_BACKPRESSURE_LOW_MS": "5000"})


def test_a_misspelled_variable_is_refused_with_the_closest_name():
    with pytest.raises(SettingsError, match="MMSTREAM_KAFKA_BOOTSTAP is not a setting; did you mean "
                                            "MMSTREAM_KAFKA_BOOTSTRAP"):
        Settings.from_env({"MMSTREAM_KAFKA_BOOTSTAP": "k:1"})
    with pytest.raises(SettingsError, match="MMSTREAM_NOTHING_LIKE_IT is not a setting"):
        Settings.from_env({"MMSTREAM_NOTHING_LIKE_IT": "1"})
    assert Settings.from_env({"OTHER_TOOL_VAR": "x", "PATH": "/bin"}) == Settings()


def test_values_parse_to_their_types_and_settings_stay_frozen():
    s = Settings.from_env({"MMSTREAM_CACHE_ENABLED": "off", "MMSTREAM_VIDEO_FPS": "2.5",
                           "MMSTREAM_LOCAL_STATE_DIR": "~/somewhere", "MMSTREAM_ENCODER_PRECISION": "int8",
                           "MMSTREAM_KAFKA_BOOTSTRAP": "a:1, b:2"})
    assert s.cache.enabled is False and s.video.fps == 2.5 and s.encoder.precision == "int8"
    assert s.local.state_dir == Path.home() / "somewhere" and s.kafka.bootstrap == "a:1,b:2"
    with pytest.raises(ValidationError):
        s.kafka.partitions = 9  # type: ignore[misc]
    with pytest.raises(ValidationError):
        KafkaSettings(partitions=2, bogus=1)  # type: ignore[call-arg]
    assert hash(s) == hash(Settings.from_env({"MMSTREAM_CACHE_ENABLED": "0", "MMSTREAM_VIDEO_FPS": "2.5",
                                              "MMSTREAM_LOCAL_STATE_DIR": "~/somewhere",
                                              "MMSTREAM_ENCODER_PRECISION": "int8",
                                              "MMSTREAM_KAFKA_BOOTSTRAP": "a:1,b:2"}))


def test_settings_alone_are_the_defaults_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("MMSTREAM_KAFKA_PARTITIONS", "9")
    assert Settings().kafka.partitions == 4
    assert Settings.from_env().kafka.partitions == 9


def test_every_variable_is_named_after_its_section_and_field():
    names = env_names()
    assert names["MMSTREAM_KAFKA_TOPIC_PREFIX"] == ("kafka", "topic_prefix")
    assert names["MMSTREAM_ADMISSION_MAX_QUEUED_MS_RT"] == ("admission", "max_queued_ms_rt")
    assert len(names) == len(describe(Settings()))


def test_value_sets_match_the_code_that_acts_on_them():
    assert set(get_args(Partitioner)) == set(STRATEGIES)
    assert ENGINE_PRECISIONS == get_args(EnginePrecision)


def test_passwords_in_urls_are_never_described():
    s = Settings.from_env({"MMSTREAM_REDIS_URL": "redis://user:s3cret@cache:6379/0"})
    assert s.redis.url.endswith("s3cret@cache:6379/0")  # the code still gets the real URL
    shown = dict((var, value) for var, value, _ in describe(s))
    assert shown["MMSTREAM_REDIS_URL"] == "redis://user:***@cache:6379/0"
    assert redact("redis://:pw@h:1/0") == "redis://:***@h:1/0" and redact("redis://h:1/0") == "redis://h:1/0"


def test_every_name_value_list_goes_through_one_parser_and_names_the_bad_item() -> None:
    from schemas.settings_base import parse_assignments, whole_number

    assert parse_assignments(" a=1, b = 2 ,", whole_number, "NAME=N") == {"a": 1, "b": 2}
    assert parse_assignments(["x=3"], whole_number, "NAME=N") == {"x": 3}
    for bad in ("a", "=1", "a=-1", "a=x"):
        with pytest.raises(ValueError, match=f"{bad!r} is not NAME=N"):
            parse_assignments(bad, whole_number, "NAME=N")


def test_cache_ttl_overrides_are_checked_when_the_settings_load() -> None:
    assert Settings.from_env({"MMSTREAM_CACHE_TTL_OVERRIDES": "audio=7200,doc=60"}).cache.ttls() == {
        "audio": 7200, "doc": 60}
    for bad in ("audio", "audio=0", "audio=1.5"):
        with pytest.raises(SettingsError, match="modality=seconds"):
            Settings.from_env({"MMSTREAM_CACHE_TTL_OVERRIDES": bad})


def test_a_placed_encoder_is_lowered_only_where_named():
    router = Settings.from_env({"MMSTREAM_ROUTER_COLOCATE_NICE": "image=10"}).router
    assert (router.nice_of("image"), router.nice_of("text")) == (10, 0)


def test_a_placed_encoder_is_passed_over_past_its_own_queue_bound():
    default = Settings().router
    assert (default.max_queued_of("text"), default.max_queued_of("image"), default.max_queued_of("audio")) == (25, 25, 25)
    text = Settings.from_env({"MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS": "text=80"}).router
    assert (text.max_queued_of("text"), text.max_queued_of("image")) == (80, 25)
    one = Settings.from_env({"MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS": "0"}).router  # a number: every modality
    assert (one.max_queued_of("text"), one.max_queued_of("image")) == (0, 0)
    pairs = Settings.from_env({"MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS": "image=40.5"}).router
    assert (pairs.max_queued_of("image"), pairs.max_queued_of("text")) == (40.5, 25)
    assert Settings(router={"colocate_max_queued_ms": 12.0}).router.max_queued_of("text") == 12
    for bad in ("-1", "nan", "inf", "text", "text=-2", "=3", "text=x"):
        with pytest.raises(SettingsError):
            Settings.from_env({"MMSTREAM_ROUTER_COLOCATE_MAX_QUEUED_MS": bad})


def test_local_processes_run_at_the_priority_named_and_the_rest_at_zero():
    local = Settings.from_env({"MMSTREAM_LOCAL_NICE": "router=-5, broker=+3,redis=0"}).local
    assert (local.nice_of("router"), local.nice_of("broker"), local.nice_of("redis"), local.nice_of("assembler")) == (
        -5, 3, 0, 0)
    assert Settings.from_env({"MMSTREAM_LOCAL_NICE": ""}).local.nice_of("router") == 0
    default = Settings().local  # the router ahead of the rest (it steps back past capacity)
    assert [default.nice_of(name) for name in ("router", "assembler", "broker", "redis", "encode.image")] == \
        [-10, 0, 0, 0, 0]
