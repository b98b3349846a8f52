"""Sending a noisy library's output to a file for the length of a block.

Exporters (torch.onnx, onnxscript, transformers) print progress from Python, from logging
and from C++ straight to file descriptors 1 and 2: only moving those descriptors, not just
``sys.stdout``, keeps the terminal to our own progress lines.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Iterator


@contextmanager
def quiet_into(log_file: Path) -> Iterator[None]:
    """Inside the block, everything written to stdout, stderr or through ``logging`` is
    appended to ``log_file`` instead; the terminal gets it back on exit, even on an error."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    with open(log_file, "ab", buffering=0) as sink, open(sink.fileno(), "w", closefd=False) as text:
        handler = logging.StreamHandler(text)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            root.handlers = [handler]
            root.setLevel(logging.INFO)
            # Python-level writers too: sys.stdout may not be fd 1 (pytest, IDEs).
            with redirect_stdout(text), redirect_stderr(text):
                yield
        finally:
            text.flush()
            root.handlers, root.level = handlers, level
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
