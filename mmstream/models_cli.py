"""`mmstream models list|build`: the models in the repository with their variants and fidelity,
and building them from the packaged weights."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mmstream.errors import UserError
from mmstream.quiet import quiet_into
from schemas.settings import Settings
from workers.engines.gate import gate_failures
from workers.repository import ModelRepository


def cmd_models(args: argparse.Namespace, settings: Settings, repo_root: Path) -> int:
    if args.models_command == "list":
        return _models_list(settings.models.repository)
    return _models_build(settings, args.only, args.force, getattr(args, "target", "cpu"))


def _models_list(root: Path) -> int:
    repo = ModelRepository(root)
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []
    if not names:
        print(f"no models in {root} (run: mmstream models build)")
    for name in names:
        for version in repo.versions(name):
            cfg = repo.resolve(name, version)
            print(f"{name} {version}  ({cfg.directory})")
            for precision, v in sorted(cfg.variants.items()):
                failures = gate_failures(v.fidelity, v.gate)
                gate = "" if not v.gate else ("  gate: passes" if not failures else f"  gate: REFUSED ({'; '.join(failures)})")
                print(f"  {precision:<5} {v.bytes / 1e6:7.1f} MB  {cfg.backend_of(precision):<14} {_fidelity(v.fidelity)}{gate}")
    return 0


def _fidelity(fidelity: Any) -> str:
    """``{"reference": "fp32", "mean_cosine": 0.998}`` as ``reference=fp32 mean_cosine=0.998``."""
    if not fidelity:
        return "(reference)"
    return " ".join(f"{k}={json.dumps(v, default=str) if not isinstance(v, str) else v}"
                    for k, v in dict(fidelity).items())


def _models_build(settings: Settings, only: list[str] | None, force: bool, target: str = "cpu") -> int:
    """Build each model with one progress line; the exporters' own chatter (thousands of
    lines from torch.onnx) goes to a log file, named when a build fails."""
    from workers.models.build import RECIPES, build_models, default_models  # the exporters' import graph: only here

    names = only or default_models()
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise UserError(f"unknown model {', '.join(unknown)}; models: {', '.join(RECIPES)}")
    log_file = settings.local.state_dir / "models-build.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", end="", flush=True)
        try:
            with quiet_into(log_file):
                report = build_models(settings.models.repository, names=[name], force=force, target=target,
                                      log=lambda line: print(line, flush=True))[0]
        except ImportError as exc:  # the exporters import torch & co. only when a model must be built
            print(" failed")
            raise UserError(f"the model build needs the build extra ({exc}): pip install -e '.[build]'") from None
        except Exception as exc:  # noqa: BLE001 - a recipe's own error: one sentence, the trace with --debug
            print(" failed")
            raise UserError(f"building {name} failed: {exc} (the exporters' log: {log_file})") from exc
        print(f" {report.status} ({report.seconds:.0f} s)  version {report.version}", flush=True)
    return 0
