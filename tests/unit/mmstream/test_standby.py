"""The hand-over to a warm spare: one JSON line on its FIFO, or False when nobody waits."""

import json
import os
import threading
from pathlib import Path

from mmstream.standby import handover


def test_no_spare_waiting_is_a_clean_false(tmp_path: Path):
    assert handover(str(tmp_path / "none.fifo"), "encode.text", 0, "x.log", {}) is False
    fifo = tmp_path / "spare.fifo"
    os.mkfifo(fifo)
    assert handover(str(fifo), "encode.text", 0, "x.log", {}) is False  # a FIFO without a reader


def test_a_waiting_spare_gets_its_stage(tmp_path: Path):
    fifo = tmp_path / "spare.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    opened = threading.Event()

    def spare() -> None:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # as the spare's blocking open, but observable
        opened.set()
        with os.fdopen(fd, "rb") as f:
            while not got:
                line = f.readline()
                if line:
                    got.append(line)

    t = threading.Thread(target=spare, daemon=True)
    t.start()
    assert opened.wait(5)
    assert handover(str(fifo), "encode.audio", 2, "/tmp/a.log", {"MMSTREAM_METRICS_PORT": "9401"}) is True
    t.join(5)
    job = json.loads(got[0])
    assert (job["stage"], job["replica"], job["log_file"], job["env"]) == ("encode.audio", 2, "/tmp/a.log",
                                                                           {"MMSTREAM_METRICS_PORT": "9401"})
    assert job["at"] > 0
