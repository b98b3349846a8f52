"""The pipeline's stages: each one a Faust app with its agents, run by ``runner.run_stage``.

This package's own module is only the table of stage names, so tools can name stages
without importing Faust and the engines.
"""

STAGES = ("router", "assembler", "encode.text", "encode.image", "encode.audio", "encode.video", "encode.any",
          "generate", "lagmon")
