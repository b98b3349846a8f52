"""`mmstream`: the command line. Each command resolves the settings once and passes them on."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from mmstream import commands
from schemas.settings import Settings, SettingsError

REPO_ROOT = Path(__file__).resolve().parents[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmstream", description="Kafka-native multimodal serving pipeline.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Kafka, Redis and the workers (idempotent)")
    up.add_argument("--replicas", action="append", default=[], metavar="STAGE=N",
                    help="workers per stage, e.g. encode.text=2 (repeatable)")
    up.add_argument("--infra-only", action="store_true", help="start Kafka and Redis only")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for a first answer")
    sub.add_parser("down", help="stop the workers, Redis and Kafka")
    sub.add_parser("status", help="what runs, where, and whether it is healthy")
    sub.add_parser("config", help="every setting, its environment variable, value and meaning")

    w = sub.add_parser("worker", help="run one stage in the foreground")
    w.add_argument("stage")
    w.add_argument("--replica", type=int, default=0)
    w.add_argument("--loglevel", default="info")

    s = sub.add_parser("send", help="send one request and print its events as JSON lines")
    s.add_argument("--text", action="append", default=[], help="a text part (repeatable)")
    for media in ("image", "audio", "video"):
        s.add_argument(f"--{media}", action="append", default=[], type=Path, metavar="PATH",
                       help=f"an {media} file as a part (repeatable)" if media != "video" else "a video file as a part (repeatable)")
    s.add_argument("--task", default="embed", choices=["embed", "generate"])
    s.add_argument("--lane", default="rt", choices=["rt", "bulk"])
    s.add_argument("--json", type=Path, help="send this JSON request file as it is")
    s.add_argument("--deadline-ms", type=int)
    s.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the answer")

    sub.add_parser("demo", help="send a set of real requests and print answers and a latency table")

    b = sub.add_parser("bench", help="open-loop Poisson benchmark (or: bench compare A.json B.json)")
    b.add_argument("action", nargs="?", default="run", choices=["run", "compare"])
    b.add_argument("inputs", nargs="*", type=Path, help="for compare: the JSON reports to put side by side")
    b.add_argument("--workload", default="text", choices=["text", "mixed", "chat"])
    b.add_argument("--scheduler", choices=["continuous", "static"],
                   help="chat: the generator's batching (runs on a pipeline of its own)")
    b.add_argument("--mode", default="pipeline", choices=["pipeline", "monolithic"])
    b.add_argument("--rate", type=float, default=20.0, help="offered requests per second")
    b.add_argument("--rates", help="sweep these rates, e.g. 5,10,20 (one run each)")
    b.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    b.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers")
    b.add_argument("--seed", type=int, default=1)
    b.add_argument("--lane", default="rt", choices=["rt", "bulk"])
    b.add_argument("--max-batch-size", type=int, help="monolithic mode: its fixed batch size")
    b.add_argument("--max-wait-ms", type=float, help="monolithic mode: its batch wait")
    b.add_argument("--lanes", help="share of each lane, e.g. rt=0.2,bulk=0.8 (default: all on --lane)")
    b.add_argument("--repeat", type=float, default=0.0, help="share of requests repeating an earlier one's content")
    for lever in ("routing", "cache", "admission", "lanes"):
        b.add_argument(f"--no-{lever}", action="store_true",
                       help=f"switch the {lever} lever off (runs on a pipeline of its own)")
    b.add_argument("--own-pipeline", action="store_true", help="run on a fresh pipeline started for this run")
    b.add_argument("--out", type=Path, help="write the JSON report here")
    b.add_argument("--report", type=Path, help="write report.md and PNG plots into this folder")

    t = sub.add_parser("top", help="live view of lag, rates and per-stage latency")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.add_argument("--interval", type=float, default=1.0)

    m = sub.add_parser("models", help="the model repository")
    msub = m.add_subparsers(dest="models_command", required=True)
    mb = msub.add_parser("build", help="export the packaged weights to ONNX (cached)")
    mb.add_argument("--force", action="store_true")
    mb.add_argument("--only", action="append", help="build only this model (repeatable)")
    mb.add_argument("--target", choices=("cpu", "gpu"), default="cpu",
                    help="gpu also builds an fp16 variant of each ONNX model, with its fidelity")
    msub.add_parser("list", help="the models in the repository")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        print(f"mmstream: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command != "worker":  # client-side commands print their own output
        logging.getLogger("aiokafka").setLevel(logging.WARNING)

    try:
        return commands.run(args, settings, REPO_ROOT)
    except commands.UserError as exc:
        print(f"mmstream: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
