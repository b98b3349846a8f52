"""Batch timings kept per engine, threads and machine, and reused while young."""

from pathlib import Path

from workers.calibration import CalibrationCache

ROWS = [(1, 8.0, 1.5), (4, 64.0, 9.25)]


def test_timings_are_reused_for_the_same_engine_and_threads_while_young(tmp_path: Path):
    cache = CalibrationCache(tmp_path)
    assert cache.load("minilm/1/int8/2", 1, 3600) is None
    cache.store("minilm/1/int8/2", 1, ROWS, now=1000.0)
    assert cache.load("minilm/1/int8/2", 1, 3600, now=2000.0) == ROWS
    assert cache.load("minilm/1/int8/2", 1, 3600, now=1000.0 + 3601) is None  # too old: time again
    assert cache.load("minilm/1/fp32/2", 1, 3600, now=2000.0) is None  # another engine
    assert cache.load("minilm/1/int8/2", 2, 3600, now=2000.0) is None  # other threads
    assert cache.load("minilm/1/int8/2", 1, 0, now=2000.0) is None  # 0: always time


def test_what_cannot_be_read_is_a_miss_and_nothing_is_kept_without_an_identity(tmp_path: Path):
    cache = CalibrationCache(tmp_path)
    cache.store("", 1, ROWS)
    cache.store("m", 1, [])
    assert list(tmp_path.iterdir()) == []
    cache.store("m", 1, ROWS)
    (f,) = tmp_path.iterdir()
    f.write_text('{"identity": "m", "at": ')
    assert cache.load("m", 1, 3600) is None
    ro = CalibrationCache(tmp_path / "file")
    (tmp_path / "file").write_text("not a dir")
    ro.store("m", 1, ROWS)  # a state dir that cannot be written: the next replica times its own
