"""`mmstream`: the command line. Each command resolves the settings once and passes them on.

Contract with the person at the terminal: a mistake they can fix (a bad flag, a missing
file, a mistyped setting, a broker that is not running) is one sentence on stderr and a
non-zero exit, never a traceback; ``--debug`` shows the traceback of any failure. Exit
codes: 0 done, 1 the command ran and failed (a DOWN component, an error event, a failure we
did not foresee), 2 a usage or configuration mistake, 3 no answer in time, 130 interrupted,
141 stdout closed early (``mmstream config | head -1``), as a Unix tool killed by SIGPIPE.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import traceback
from importlib import metadata
from pathlib import Path

from aiokafka.errors import KafkaConnectionError, KafkaError
from redis.exceptions import ConnectionError as RedisConnectionError

from mmstream import collections_cli, commands
from mmstream.bench.config import WORKLOADS
from mmstream.lever_names import LEVERS
from mmstream.report import ReportError
from schemas.settings import Settings, SettingsError
from streams.sdk.client import ClientError
from streams.stages import stage_names

REPO_ROOT = Path(__file__).resolve().parents[1]
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 1, 2, 130, 141
DEBUG_HELP = "show the full traceback of any failure, and debug logs"


def _version() -> str:
    try:
        return metadata.version("mmstream")
    except metadata.PackageNotFoundError:  # run from a checkout without installing
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    """Every command and flag, each with its help text (a test holds the parser to that)."""
    p = argparse.ArgumentParser(prog="mmstream", description="Kafka-native multimodal serving pipeline.",
                                epilog="Settings come from MMSTREAM_<SECTION>_<FIELD> variables: see `mmstream config`.")
    p.add_argument("--version", action="version", version=f"mmstream {_version()}")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    # --debug also after the command (`mmstream send --debug ...`); SUPPRESS keeps the
    # subcommand from resetting a --debug given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cmd = functools.partial(sub.add_parser, parents=[common])

    up = cmd("up", help="start Kafka, Redis and the workers (idempotent)")
    up.add_argument("--replicas", action="append", default=[], metavar="STAGE=N",
                    help="workers per stage, e.g. encode.text=2 (repeatable)")
    up.add_argument("--infra-only", action="store_true", help="start Kafka and Redis only")
    up.add_argument("--timeout", type=float, default=180.0, metavar="S",
                    help="seconds to wait for a first answer (default: %(default)s)")
    up.add_argument("--secure", action="store_true",
                    help="start the secured broker instead (SASL_SSL with a local CA, ACLs, its own ports "
                         "MMSTREAM_LOCAL_KAFKA_SECURE_*); the workers log in as the service principal, and its "
                         "settings are written to a file to source (`tenant add` finds them itself). Workers of "
                         "the same topic prefix running against the other broker are refused: `mmstream down` first")
    up.add_argument("--autoscale", action="store_true",
                    help="also start the local scaler: each pool of MMSTREAM_AUTOSCALE_POOLS then grows and shrinks "
                         "on its lag and queued work, idle ones down to their minimum (see `mmstream scale`); "
                         "without it, `up` stops a running scaler and the replicas stay as started")
    pl = cmd("plan", help="replicas, partitions and utilisation for a target rate, from a bench run's measured cost")
    pl.add_argument("--from", dest="run_file", type=Path, required=True, metavar="RUN.json",
                    help="a `mmstream bench --out` file: its CPU per request per process is the cost")
    pl.add_argument("--run-rate", type=float, metavar="R", help="which run of a sweep (default: its highest rate)")
    pl.add_argument("--rate", type=float, required=True, metavar="R", help="the target requests per second")
    pl.add_argument("--machines", type=int, default=1, metavar="N", help="machines (default: %(default)s)")
    pl.add_argument("--cores", type=int, metavar="C", help="cores per machine (default: this one's)")
    pl.add_argument("--target-util", type=float, default=0.7, metavar="U",
                    help="busy share of the cores to plan for (default: %(default)s)")
    cmd("down", help="stop the workers, Redis and Kafka")
    sc = cmd("scale", help="the pools the local scaler manages: replicas now, bounds, and its last decisions")
    sc.add_argument("--last", type=int, default=10, metavar="N", help="decisions to show (default: %(default)s)")
    sc.add_argument("--keda", action="store_true",
                    help="print the KEDA ScaledObjects these settings generate (what infra/k8s/mmstream.yaml holds)")
    cmd("status", help="what runs, where, and whether it is healthy (exit 1 if anything is down)")
    c = cmd("config", help="every setting, its environment variable, value and meaning")
    c.add_argument("--check", action="store_true",
                   help="only validate the MMSTREAM_* environment: one line, exit 0 if valid, 2 if not")

    w = cmd("worker", help="run one stage in the foreground (what `mmstream up` starts per replica)")
    w.add_argument("stage", metavar="STAGE",
                   help=f"the stage to run: {', '.join(stage_names())}, or autoscale (the local scaler; "
                        "a plugin modality's stage is encode.<name>)")
    w.add_argument("--replica", type=int, default=0, metavar="N",
                   help="replica number, for its log and port files (default: %(default)s)")
    w.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"],
                   help="Faust's and our log level (default: %(default)s)")

    s = cmd("send", help="send one request and print its events as JSON lines")
    s.add_argument("--text", action="append", default=[], help="a text part (repeatable)")
    for media in ("image", "audio", "video"):
        s.add_argument(f"--{media}", action="append", default=[], type=Path, metavar="PATH",
                       help=f"{'an' if media == 'image' or media == 'audio' else 'a'} {media} file as a part (repeatable)")
    s.add_argument("--task", default="embed", choices=["embed", "generate"],
                   help="embed: one embedding per part; generate: a streamed answer (default: %(default)s)")
    s.add_argument("--lane", default="rt", choices=["rt", "bulk"],
                   help="rt (interactive, served first) or bulk (shed first under load) (default: %(default)s)")
    s.add_argument("--json", type=Path, metavar="FILE", help="send this JSON request file as it is (other part flags are ignored)")
    s.add_argument("--deadline-ms", type=int, metavar="MS",
                   help="drop the request if not done within MS milliseconds of acceptance (default: the server's)")
    s.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait for the answer (default: %(default)s)")
    s.add_argument("--retries", type=int, default=3, metavar="N",
                   help="resend a request answered with a retriable error (overloaded...) up to N times, after "
                        "its retry_after_ms with jittered backoff; 0: never (--json requests are never resent) "
                        "(default: %(default)s)")

    s.add_argument("--properties", type=Path, metavar="FILE",
                   help="send as the tenant of this client properties file (from `mmstream tenant add`): its "
                        "credentials, ingress and reply topics")

    tn = cmd("tenant", help="tenants of a secured deployment")
    tsub = tn.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    ta = functools.partial(tsub.add_parser, parents=[common])(
        "add", help="create a tenant's credentials, topics and ACLs, and write its client properties file",
        description="Create a tenant's SCRAM credential, topics and ACLs on a SASL broker, as the service principal, "
                    "and write its client properties file. The broker is the one the MMSTREAM_KAFKA_* settings name; "
                    "when they name no SASL broker and the local secure broker of `mmstream up --secure` runs, it is "
                    "that one (no need to source its mmstream.env first).")
    ta.add_argument("name", metavar="NAME", help="the tenant (lowercase letters, digits, _ and -): its SASL user")
    ta.add_argument("--lanes", action="append", metavar="LANE[,LANE]",
                    help="lanes it may send on: rt, bulk (repeatable; default: both)")
    ta.add_argument("--out", type=Path, metavar="FILE",
                    help="where to write its properties file (default: <state_dir>/tenants/<prefix>/NAME.properties)")

    collections_cli.add_parser(cmd, common)

    cmd("demo", help="send a set of real requests and print answers and a latency table")

    b = cmd("bench", help="open-loop Poisson benchmark (or: bench compare A.json B.json)")
    b.add_argument("action", nargs="?", default="run", choices=["run", "compare"],
                   help="run a benchmark (default) or compare JSON reports")
    b.add_argument("inputs", nargs="*", type=Path, help="for compare: the JSON reports to put side by side")
    b.add_argument("--workload", default="text", choices=list(WORKLOADS), help="request mix (default: %(default)s; chat-mm: a question beside a photo; capacity: 60%% texts of 1, 4 or 15 sentences, 40%% photos of 256-1024 px; images: those photos alone; audio: spoken clips alone; fairness: tenant B's rt text alone, then beside tenant A's flood of the worst requests allowed; retrieve: searches of a collection of --docs passages, --repeat of them near-duplicates; rag: generate grounded in that collection, prefix cache on and off; retrieve-images: image searches of a collection of --docs photo variants)")
    b.add_argument("--abuse-rate", type=float, help="fairness: tenant A's offered requests per second (default: 5x --rate)")
    b.add_argument("--victim-images", type=float, metavar="SHARE",
                   help="fairness: the share of tenant B's requests that are a photo each (default: 0, texts only)")
    b.add_argument("--abuse-shapes", metavar="A,B",
                   help="fairness: what tenant A sends, some of max_text, max_images, ref_fanout, max_generate, "
                        "max_audio (default: every one the deployment serves)")
    b.add_argument("--abuse-deadline-ms", type=int, help="fairness: deadline of A's requests (default: the longest allowed)")
    b.add_argument("--docs", type=int, metavar="N",
                   help="retrieve, rag: passages of the offline corpus indexed first (default: 2000)")
    b.add_argument("--scheduler", choices=["continuous", "static"],
                   help="chat: the generator's batching (runs on a pipeline of its own)")
    b.add_argument("--lm-precision", choices=["q4_1", "fp32", "int8"],
                   help="chat: the generator's LM variant, q4_1 on llama.cpp or fp32/int8 on ONNX Runtime "
                        "(runs on a pipeline of its own)")
    b.add_argument("--chat-max-tokens", type=int, default=32, help="chat: max_tokens of each request (default: %(default)s)")
    b.add_argument("--mode", default="pipeline", choices=["pipeline", "monolithic", "server"],
                   help="the pipeline; monolithic: one process, one FIFO for every model; server: one process, a queue and engine thread per model (a generic model server) (default: %(default)s)")
    b.add_argument("--rate", type=float, default=20.0, help="offered requests per second (default: %(default)s)")
    b.add_argument("--rates", help="sweep these rates, e.g. 5,10,20 (one run each)")
    b.add_argument("--rate-schedule", metavar="RATE:S,...",
                   help="one run whose offered rate steps through these segments, e.g. 10:30,90:60,10:60; the "
                        "report adds latency, outcomes and replicas per stage over time")
    b.add_argument("--autoscale", action="store_true",
                   help="run on a pipeline of its own with the local scaler (compare with a run without it)")
    b.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals (default: %(default)s)")
    b.add_argument("--drain", type=float, default=30.0, help="seconds to wait for stragglers (default: %(default)s)")
    b.add_argument("--seed", type=int, default=1, help="seed of arrivals and contents: same seed, same traffic")
    b.add_argument("--lane", default="rt", choices=["rt", "bulk"], help="lane of every request (default: %(default)s)")
    b.add_argument("--max-batch-size", type=int, help="monolithic mode: its fixed batch size")
    b.add_argument("--max-wait-ms", type=float, help="monolithic mode: its batch wait")
    b.add_argument("--lanes", help="share of each lane, e.g. rt=0.2,bulk=0.8 (default: all on --lane)")
    b.add_argument("--repeat", type=float, default=0.0, help="share of requests repeating an earlier one's content")
    for lever in LEVERS:
        b.add_argument(f"--no-{lever}", action="store_true",
                       help=f"switch the {lever} lever off (runs on a pipeline of its own)")
    b.add_argument("--own-pipeline", action="store_true", help="run on a fresh pipeline started for this run")
    b.add_argument("--vs", choices=["server", "monolithic"],
                   help="run this baseline right after each pipeline run and report each round's ratios (CPU per "
                        "request, text and image latency) and their median (see --rounds)")
    b.add_argument("--rounds", type=int, default=1,
                   help="runs of each mode per rate, alternating with --vs (default: %(default)s)")
    b.add_argument("--out", type=Path, help="write the JSON report here")
    b.add_argument("--report", type=Path, help="write report.md and PNG plots into this folder (needs the report extra)")

    ch = cmd("chaos", help="fault scenarios: run each on a pipeline of its own and check every invariant")
    chsub = ch.add_subparsers(dest="chaos_command", required=True, metavar="ACTION")
    chr_ = chsub.add_parser("run", parents=[common],
                            help="run scenario files (chaos/scenarios/*.json); exit 0 only if every invariant held")
    chr_.add_argument("scenarios", nargs="+", type=Path, metavar="FILE", help="scenario files, run one after another")
    chr_.add_argument("--out", type=Path, metavar="FILE", help="also write the results as a JSON list to FILE")
    chr_.add_argument("--workdir", type=Path, metavar="DIR",
                      help="keep each run's logs and state under DIR/<scenario> (default: a temporary folder)")

    t = cmd("top", help="live view of lag, rates and per-stage latency")
    t.add_argument("--once", action="store_true", help="print one frame and exit")
    t.add_argument("--json", action="store_true", help="print one JSON document per frame instead of tables")
    t.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between frames (default: %(default)s)")

    m = cmd("models", help="the model repository")
    msub = m.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    mcmd = functools.partial(msub.add_parser, parents=[common])
    mb = mcmd("build", help="export the packaged weights to ONNX (cached): one progress line per model")
    mb.add_argument("--force", action="store_true", help="rebuild even when an up-to-date build exists")
    mb.add_argument("--only", action="append", metavar="NAME", help="build only this model (repeatable)")
    mb.add_argument("--target", choices=("cpu", "gpu"), default="cpu",
                    help="gpu also builds an fp16 variant of each ONNX model, with its fidelity")
    mcmd("list", help="the models in the repository, their variants and fidelity")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)  # argparse itself says what is wrong and exits 2
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say to anyone. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command != "worker":  # client-side commands print their own output
        for name in ("aiokafka", "kafka"):
            logging.getLogger(name).setLevel(logging.DEBUG if args.debug else logging.CRITICAL)
    bootstrap = "the configured broker"
    try:
        settings = Settings.from_env()
        bootstrap = settings.kafka.bootstrap
        return commands.run(args, settings, REPO_ROOT)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        raise
    except (SettingsError, commands.UserError) as exc:
        return _fail(args, str(exc), EXIT_USAGE)
    except KafkaConnectionError:
        return _fail(args, f"cannot reach Kafka at {bootstrap}: is it running? (start it with `mmstream up`, or "
                           "point MMSTREAM_KAFKA_BOOTSTRAP at your cluster)", EXIT_FAILED)
    except RedisConnectionError as exc:
        return _fail(args, f"cannot reach Redis ({exc}): is it running? (`mmstream up`, or set MMSTREAM_REDIS_URL)",
                     EXIT_FAILED)
    except (ClientError, KafkaError, ReportError) as exc:
        return _fail(args, str(exc) or type(exc).__name__, EXIT_FAILED)
    except Exception as exc:  # noqa: BLE001 - the last line of defence: one sentence, not a trace
        hint = "" if args.debug else " (--debug shows the traceback)"
        return _fail(args, f"unexpected {type(exc).__name__}: {exc}{hint}", EXIT_FAILED)


def _fail(args: argparse.Namespace, sentence: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"mmstream: {sentence}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
