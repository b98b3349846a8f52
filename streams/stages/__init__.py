"""The pipeline's stages: each one a record loop (``streams.runtime.stage.RecordStage``) on a
Faust app that hosts its services, run by ``runner.run_stage``.

This package's own module is only the list of stage names, so tools can name stages
without importing Faust: the fixed stages plus one ``encode.<name>`` per registered
modality (``workers/modalities``), in registration order. Plugins must be loaded before
asking (``workers.modalities.load_plugins``).
"""

from workers import modalities

BASELINE_POOL = "encode.any"
"""The no-routing baseline's one shared pool: a stage, but started only when asked for."""


def stage_names() -> tuple[str, ...]:
    """Every stage a worker can run, for the modalities registered now."""
    return ("router", "assembler", *(s.stage for s in modalities.specs()), BASELINE_POOL, "generate", "index", "retrieve",
            "lagmon")
