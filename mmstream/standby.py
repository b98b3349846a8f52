"""A warm spare: a worker process that has already paid for its imports and waits for a stage.

A cold start spends 0.9-1.7 s of its 2-4 s on this box importing (Faust and aiohttp, aiokafka,
numpy, pydantic, Redis, the engines' modules: docs/autoscaling.md), before any model loads. The
local scaler keeps one spare per topic prefix: ``python -m mmstream.standby FIFO`` imports what
every stage imports, then blocks reading its FIFO. ``Supervisor.spawn_missing`` with spares on
hands the spare a stage by writing one JSON line to the FIFO (stage, replica, log file, the
environment the stage runs with), adopts its pid, and starts the next spare. The spare points its
output at the stage's log, takes the environment, counts its cold start from the hand-over (not
from its own fork, which was long before), and runs ``mmstream worker`` in place.

A spare that is gone (killed, or never ready) is found out at hand-over: the FIFO has no reader,
so opening it without blocking fails, and the supervisor starts the stage the ordinary way.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time


def handover(fifo: str, stage: str, replica: int, log_file: str, env: dict[str, str]) -> bool:
    """Give ``stage`` to the spare reading ``fifo``; False (nothing sent) when none is waiting."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader; ENOENT: no spare
        return False
    try:
        line = json.dumps({"stage": stage, "replica": replica, "log_file": log_file, "env": env,
                           "at": time.time()}) + "\n"
        os.write(fd, line.encode())  # under PIPE_BUF for any sane environment: one atomic write
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    fifo = argv[0]
    from streams.runtime.parent import PARENT_PID_ENV, stop_with_parent

    # A spare of a tied pipeline (local.parent_pid) does not wait for ever once its supervisor is gone.
    watch = stop_with_parent(int(os.environ.get(PARENT_PID_ENV) or 0))
    # What every stage imports (the CLI, the runner, the engines' modules), before waiting.
    import mmstream.cli  # noqa: F401
    import streams.stages.encoder  # noqa: F401
    import streams.stages.runner  # noqa: F401
    from streams.observe.health import process_health
    from workers import modalities

    # A modality names its compute instead of importing it; a spare imports the modules the
    # registered runners name (tokenizers, image and audio decoders), without building one.
    for spec in modalities.specs():
        if isinstance(spec.runner, str):
            importlib.import_module(spec.runner.partition(":")[0])

    print(f"standby: imports done, waiting for a stage on {fifo}", flush=True)
    with open(fifo, "rb") as f:  # blocks until the supervisor opens it for writing
        line = f.readline()
    if not line:
        return 0  # the supervisor went away without a stage: nothing to run
    job = json.loads(line)
    if watch is not None:
        watch.set()  # the stage watches with the environment it is handed (mmstream.commands.cmd_worker)
    log = os.open(job["log_file"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(job["env"])
    process_health().born_at = float(job["at"])
    return mmstream.cli.main(["worker", job["stage"], "--replica", str(job["replica"])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
