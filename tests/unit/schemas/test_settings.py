import pytest

from schemas.settings import Settings, SettingsError, describe


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
