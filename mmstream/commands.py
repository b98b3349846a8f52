"""What each `mmstream` command does (the parser lives in cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from mmstream import collections_cli, engineinfo, localstack, models_cli, scale_cli
from mmstream.console import event_line
from mmstream.errors import UserError
from mmstream.kafka_admin import KafkaAdminError
from mmstream.localstack import LocalStackError
from mmstream.supervisor import AUTOSCALER, Supervisor, WorkersElsewhereError, default_replicas, parse_replicas
from mmstream.tenants import TenantError, add_tenant, check_name, properties_text
from schemas.codec import JSON
from schemas.request import Lane, Modality, Part, Request, Task
from schemas.settings import Settings, describe, redact
from streams.sdk.client import Client, new_id, wait_until_serving
from streams.connection import KafkaSecurity, client_kwargs
from streams.sdk.retry import RetryConfig
from streams.stages import stage_names
from streams.runtime.parent import PARENT_PID_ENV
from streams.topics import ensure_topics, topic_specs
from workers import modalities
from workers.repository import ModelNotFoundError, ModelRepository



def run(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    try:  # before anything lists stages, topics or modalities
        modalities.load_plugins(settings.modalities.plugins)
    except modalities.ModalityError as exc:
        raise UserError(str(exc)) from None
    handler = {
        "up": cmd_up, "down": cmd_down, "status": cmd_status, "config": cmd_config, "worker": cmd_worker,
        "send": cmd_send, "demo": cmd_demo, "bench": cmd_bench, "top": cmd_top, "models": models_cli.cmd_models,
        "chaos": cmd_chaos,
        "tenant": cmd_tenant, "collection": cmd_collection, "scale": scale_cli.cmd_scale,
        "plan": scale_cli.cmd_plan,
    }[args.command]
    return handler(args, settings, repo_root)


def _localstack_call(fn: Any, *a: Any, **kw: Any) -> Any:
    try:
        return fn(*a, **kw)
    except LocalStackError as exc:
        raise UserError(str(exc)) from None


def cmd_up(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    env = None
    secure = getattr(args, "secure", False)
    if secure:
        env = {**os.environ, **localstack.secure_env(settings, repo_root)}
        settings = Settings.from_env(env)  # every client below, and every worker, as the service principal
    # `up`'s workers outlive the command: never tied to it, whatever the calling shell exports.
    env = {k: v for k, v in (os.environ if env is None else env).items() if k != PARENT_PID_ENV}
    supervisor = Supervisor(settings, env)
    if not args.infra_only:  # refuse before starting anything, not after a probe that cannot be answered
        try:
            supervisor.check_broker()
        except WorkersElsewhereError as exc:
            raise UserError(_workers_elsewhere(exc, settings, repo_root, secure)) from None
    kafka, redis = _localstack_call(localstack.up, settings, repo_root, secure=secure)
    print(f"kafka  {kafka.bootstrap}  pid={kafka.pid}  {'external' if kafka.external else 'local'}"
          f"{'  SASL_SSL' if secure else ''}")
    print(f"redis  {redact(settings.redis.url)}  pid={redis.pid}")
    if secure:
        env_file = localstack.write_secure_env(settings, repo_root)
        print(f"secure settings (service principal) in {env_file}; `mmstream tenant add` finds them while this "
              f"broker runs, other shells and clients: set -a; . {env_file}; set +a")
    created = asyncio.run(ensure_topics(settings.kafka.bootstrap, topic_specs(settings.kafka, settings.dlq),
                                        settings.kafka.replication_factor, client_kwargs(settings)))
    if created:
        print(f"topics created: {len(created)}")
    if args.infra_only:
        return 0
    try:
        replicas = {**default_replicas(), **parse_replicas(args.replicas), AUTOSCALER: int(args.autoscale)}
    except ValueError as exc:
        raise UserError(str(exc)) from None
    _ensure_models(settings)
    try:
        workers = supervisor.start(replicas)
    except WorkersElsewhereError as exc:  # another `up` started them meanwhile
        raise UserError(_workers_elsewhere(exc, settings, repo_root, secure)) from None
    except ValueError as exc:  # an unknown stage in --replicas
        raise UserError(str(exc)) from None
    for w in workers:
        print(f"worker {w.stage}[{w.replica}]  pid={w.pid}  log={w.log_file}")
    print("waiting for the pipeline to answer a probe request ...", flush=True)
    # With a generator, ready means it answers too (it loads and calibrates after the rest).
    task = Task.GENERATE if replicas.get("generate", 0) > 0 else Task.EMBED
    elapsed = asyncio.run(_probe(settings, args.timeout, task))
    print(f"ready: a probe request was answered end to end ({elapsed:.1f} s after start)")
    print("stop everything with: mmstream down")
    return 0


def _workers_elsewhere(exc: WorkersElsewhereError, settings: Settings, repo_root: Path, secure: bool) -> str:
    """One sentence for `up` while workers of its topic prefix run against the other broker:
    a prefix has one set of workers (one pid file per stage and replica), and those could
    never answer this broker's probe."""
    if exc.theirs == localstack.secure_kafka(settings, repo_root).bootstrap:
        theirs = f"the secure broker {exc.theirs} (`mmstream up --secure`)"
    elif exc.theirs:
        theirs = f"{exc.theirs} ({'a plain `mmstream up`' if secure else 'another broker'})"
    else:
        theirs = "a broker their pid files do not name"
    command = "mmstream up --secure" if secure else "mmstream up"
    return (f"the workers of topic prefix {settings.kafka.topic_prefix!r} are running against {theirs}, not "
            f"{settings.kafka.bootstrap}: stop them first with `mmstream down`, then run `{command}` again")


def _ensure_models(settings: Settings) -> None:
    """Every registered modality's model and the language model are in the repository."""
    names = [s.model_name(settings) for s in modalities.specs()] + [settings.models.lm_model]
    try:
        for name in dict.fromkeys(n for n in names if n):
            ModelRepository(settings.models.repository).resolve(name)
    except ModelNotFoundError as exc:
        raise UserError(f"{exc} (run: mmstream models build)") from None


async def _probe(settings: Settings, timeout_s: float, task: Task = Task.EMBED) -> float:
    try:
        return await wait_until_serving(settings.kafka.bootstrap, settings.kafka.topic_prefix, timeout_s,
                                        KafkaSecurity.from_settings(settings.kafka), task=task)
    except TimeoutError:
        raise UserError(f"the pipeline did not answer within {timeout_s:.0f} s; see the worker logs "
                        f"({settings.local.state_dir / 'workers'})") from None


def cmd_down(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    n = Supervisor(settings).stop()
    print(f"workers stopped: {n}")
    kafka, redis = _localstack_call(localstack.down, settings, repo_root)
    print(f"kafka  {'running (external, left alone)' if kafka.running else 'stopped'}")
    print(f"redis  {'running (external, left alone)' if redis.running else 'stopped'}")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    kafka, redis = _localstack_call(localstack.status, settings, repo_root)
    print(f"kafka   {kafka.bootstrap:<22} {'healthy' if kafka.healthy else 'DOWN':<8} pid={kafka.pid}"
          f"{' (external)' if kafka.external else ''}  data={kafka.data_dir}  log={kafka.log_file}")
    print(f"redis   {redact(settings.redis.url):<22} {'healthy' if redis.healthy else 'DOWN':<8} pid={redis.pid}")
    workers = Supervisor(settings).workers()
    if not workers:
        print("workers none (start them with: mmstream up)")
    for w in workers:
        port = w.metrics_port
        metrics = f"metrics=http://127.0.0.1:{port}/metrics" if port else "metrics=(not bound yet)"
        engine, cold = engineinfo.scrape_all(port) if port and w.alive else (None, None)
        print(f"worker  {w.stage + '[' + str(w.replica) + ']':<22} {'running' if w.alive else 'DEAD':<8} "
              f"pid={w.pid}  {metrics}  log={w.log_file}" + (f"\n        engine: {engine}" if engine else "")
              + (f"\n        cold start: {cold}" if cold else ""))
    healthy = kafka.healthy and redis.healthy and all(w.alive for w in workers)
    return 0 if healthy else 1


def cmd_config(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    """Every setting with its value and doc; with ``--check``, one line saying the environment
    is valid (an invalid one never gets here: the settings are read before any command)."""
    rows = describe(settings)
    if args.check:
        defaults = {var: value for var, value, _ in describe(Settings())}
        changed = [var for var, value, _ in rows if value != defaults.get(var)]
        print(f"ok: {len(rows)} settings valid, {len(changed)} set from the environment"
              + (f" ({', '.join(changed)})" if changed else ""))
        return 0
    for var, value, doc in rows:
        print(f"{var}={value}\n    {doc}")
    return 0


def cmd_worker(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    from streams.runtime.parent import stop_with_parent

    stop_with_parent(settings.local.parent_pid)  # a bench's or a test's own pipeline: not past its owner
    nice = settings.local.nice_of(args.stage)
    if nice:  # before the engines start their threads, which inherit it
        from streams.runtime import priority

        priority.apply_logged(f"worker {args.stage}", os.getpid(), nice)
    if args.stage == AUTOSCALER:
        from mmstream.autoscaler import run_autoscaler  # the broker and Redis clients: only for this command

        run_autoscaler(settings, args.replica)
        return 0
    if args.stage not in stage_names():
        raise UserError(f"unknown stage {args.stage!r}; stages: {', '.join(stage_names())}")
    from streams.stages.runner import run_stage  # loads Faust and the engines: only for this command

    run_stage(settings, args.stage, args.replica, args.loglevel)
    return 0


def cmd_send(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    props = getattr(args, "properties", None)
    if props is not None and not props.is_file():
        raise UserError(f"{props} is not a file (a client properties file from `mmstream tenant add`)")
    if args.json:
        payload = _read_json_request(args.json)
        payload.setdefault("id", new_id())
        return asyncio.run(_send_raw(settings, payload, args.timeout, props))
    parts = [Part(Modality.TEXT, text=t) for t in args.text]
    for media in ("image", "audio", "video"):
        for path in getattr(args, media):
            parts.append(_file_part(Modality(media), path, settings))
    if not parts:
        raise UserError("give at least one part: --text TEXT, --image/--audio/--video PATH (or --json FILE)")
    req = Request(id=new_id(), parts=tuple(parts), task=Task(args.task), lane=Lane(args.lane),
                  deadline_ms=args.deadline_ms)
    if args.retries < 0:
        raise UserError(f"--retries must be 0 or more, not {args.retries}")
    return asyncio.run(_send(settings, req, args.timeout, RetryConfig(max_attempts=args.retries + 1), props))


def _read_json_request(path: Path) -> dict[str, Any]:
    """The request in ``path`` as a JSON object; raises ``UserError`` saying what is wrong."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, not a JSON request file") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: --json takes a JSON request file") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(payload, dict):
        raise UserError(f"{path} holds a JSON {type(payload).__name__}, not a request object "
                        '(e.g. {"parts": [{"modality": "text", "text": "hi"}]})')
    return payload


def _file_part(modality: Any, path: Path, settings: Settings) -> Any:
    import mimetypes

    if not path.is_file():
        raise UserError(f"{path} is not a file")
    # Over the inline limit, the client stores the bytes in Redis and sends a claim check.
    return Part(modality, data=path.read_bytes(), mime=mimetypes.guess_type(path.name)[0])


def _client(settings: Settings, props: Path | None, **kwargs: Any) -> Client:
    """The SDK client of `mmstream send`: as the tenant of ``props``, or as the settings say."""
    if props is None:
        return Client(settings.kafka.bootstrap, settings.kafka.topic_prefix,
                      security=KafkaSecurity.from_settings(settings.kafka), **kwargs)
    try:
        return Client.from_properties(props, settings.kafka.topic_prefix, **kwargs)
    except (OSError, ValueError) as exc:
        raise UserError(f"{props}: {exc}") from None


async def _send(settings: Settings, req: Any, timeout_s: float, retry: RetryConfig, props: Path | None = None) -> int:
    async with _client(settings, props, redis_url=settings.redis.clients, inline_limit_bytes=settings.limits.max_inline_bytes,
                       redis_tls_ca=settings.redis.tls_ca, claim_ttl_s=settings.limits.claim_ttl_s, retry=retry) as client:
        return await _follow(await client.submit(req), timeout_s)


async def _follow(sub: Any, timeout_s: float) -> int:
    """Print each event of ``sub`` as a JSON line; 0 on a result, 1 on an error, 3 on silence."""

    try:
        async for event in sub.events(timeout_s):
            print(event_line(event), flush=True)
            if event.terminal:
                return 0 if event.kind == "result" else 1
    except asyncio.TimeoutError:
        print(f"mmstream: no answer to {sub.id} within {timeout_s:.0f} s", file=sys.stderr)
        return 3
    return 1


async def _send_raw(settings: Settings, payload: dict[str, Any], timeout_s: float, props: Path | None = None) -> int:
    """Send a JSON request exactly as written (JSON on the wire), then follow its events."""

    async with _client(settings, props) as client:
        rid = str(payload["id"])
        payload.setdefault("reply_to", client.reply_to)
        sub = await client.submit_raw(rid, json.dumps(payload).encode(), JSON, str(payload.get("lane", "rt")))
        return await _follow(sub, timeout_s)


def write_properties(path: Path, text: str) -> None:
    """Write a file that holds a password: mode 0600 before a byte is written, an existing
    file's mode included (``O_CREAT``'s mode applies only to a new file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def cmd_tenant(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    """`tenant add NAME`: credentials, topics and ACLs, and the tenant's properties file."""
    settings = _service_settings(settings, repo_root)
    try:
        check_name(args.name, settings)
        # The Redis user first: if that fails, the tenant's Kafka password is not yet replaced.
        redis_url = _tenant_redis_user(settings, repo_root, args.name)
        tenant = asyncio.run(add_tenant(settings, args.name, args.lanes))
    except TenantError as exc:
        raise UserError(str(exc)) from None
    except KafkaAdminError as exc:
        raise UserError(f"the broker refused: {exc} (the service principal needs ALTER on the cluster)") from None
    out = args.out or settings.local.state_dir / "tenants" / settings.kafka.topic_prefix / f"{tenant.name}.properties"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_properties(out, properties_text(tenant, settings.kafka.topic_prefix, redis_url))
    print(f"tenant {tenant.name}: lanes {', '.join(tenant.lanes)}; client properties in {out}"
          + ("; its own Redis user for claim checks" if redis_url else ""))
    print(f"send as it with: mmstream send --properties {out} --text hello")
    return 0


def _tenant_redis_user(settings: Settings, repo_root: Path, tenant: str) -> str:
    """The URL of the tenant's own Redis user (SET and GET of its claim checks only), made on
    the local secured Redis when that is the one the settings name; '' (and a note saying
    what to do) for a Redis this command does not manage."""
    local = localstack.redis_for(settings, repo_root)
    if not (local.secured and local.status().pid is not None):
        print("mmstream: Redis is not a secured one of `mmstream up --secure`: give the tenant a Redis user of its "
              f"own for claim checks yourself (keys mm:claim:{tenant}:*, GET and SET only; see README, Security)",
              file=sys.stderr)
        return ""
    password = secrets.token_urlsafe(24)
    try:
        local.add_client_user(tenant, password, tenant)
    except LocalStackError as exc:
        raise UserError(f"the tenant's Redis user: {exc}") from None
    return local.user_url(tenant, password)


def _service_settings(settings: Settings, repo_root: Path) -> Settings:
    """The settings a command that needs the service principal of a SASL broker runs with:
    the environment's when it names a SASL broker; else, while the local secure broker of
    `mmstream up --secure` runs, that broker as the service principal (what its mmstream.env
    holds, so nobody has to source it first); else the environment's, which the command
    refuses saying why."""
    broker = localstack.secure_kafka(settings, repo_root)
    if settings.kafka.authenticated or not broker.running():
        return settings
    print(f"mmstream: the environment names no SASL broker; using the local secure broker {broker.bootstrap} "
          "(`mmstream up --secure`) as its service principal", file=sys.stderr)
    return Settings.from_env({**os.environ, **localstack.secure_env(settings, repo_root)})


def cmd_collection(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    """`collection add|put|delete|search` (mmstream/collections_cli.py)."""
    return collections_cli.run(args, settings, _client, _follow, lambda: _service_settings(settings, repo_root),
                               UserError)


def cmd_demo(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    from mmstream.demo import run_demo  # the sample media need PIL, PyAV and espeak: only here

    return asyncio.run(run_demo(settings))


def cmd_bench(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    from mmstream import bench  # the monolithic baseline loads the engines: only for this command

    return bench.cli_main(args, settings)


def cmd_chaos(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    """Run each scenario file in turn; print one JSON result each and a summary table."""
    from mmstream.chaos import runner, scenario  # the media samples and the runner: only here

    try:
        loaded = [scenario.load(path) for path in args.scenarios]
    except scenario.ScenarioError as exc:
        raise UserError(str(exc)) from None
    results = []
    for sc in loaded:
        print(f"chaos: {sc.name}: {sc.about}", file=sys.stderr, flush=True)
        workdir = args.workdir / sc.name if args.workdir else None
        result = asyncio.run(runner.run(settings, sc, repo_root, workdir))
        runner.print_result(result)
        results.append(result)
    print("| scenario | requests | faults | lost | duplicated | p99 during the fault | time to recover | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    if args.out:
        args.out.write_text(json.dumps([runner.to_json(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


def cmd_top(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    from mmstream import top  # rich's live view: only for this command

    return top.cli_main(args, settings)
