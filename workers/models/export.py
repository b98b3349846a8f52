"""Model-independent steps of a build: torch -> ONNX, and ONNX fp32 -> int8.

torch, onnx and the quantizer are imported inside the functions: runtime workers import
``workers.models`` only to find out whether a build is needed, and have no torch.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

OPSET = 18
# The exporter logs every op it registers at INFO; nothing a build can act on.
_EXPORTER_REGISTRATION_LOG = "torch.onnx._internal.exporter._registration"


def quiet_exporter() -> None:
    """Silence the exporter's op-registration log (call before ``torch.onnx.export``)."""
    logging.getLogger(_EXPORTER_REGISTRATION_LOG).setLevel(logging.ERROR)


@contextmanager
def quiet_quantizer() -> Iterator[None]:
    """Hold the root logger at ERROR while ONNX Runtime's quantizer runs.

    The quantizer logs (on the root logger) advice to run its shape pre-processing first;
    that pre-processing fails on the dynamo exporter's graphs (incomplete symbolic shape
    inference), so the advice cannot be followed and is silenced.
    """
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def export_onnx(
    module: Any,
    example_inputs: tuple[Any, ...],
    path: Path,
    input_names: Sequence[str],
    output_name: str,
    dynamic_axes: dict[str, dict[int, str]],
) -> None:
    """Export ``module`` (a torch module in eval mode) to one self-contained ONNX file.

    ``dynamic_axes`` maps input name -> {axis: axis name}; axes that share a name share a
    size. The output's first axis is the batch. Raises whatever the exporter raises, and
    ``onnx.checker.ValidationError`` when the written model is invalid.
    """
    import onnx
    import torch

    dims: dict[str, Any] = {}
    shapes = {
        name: {axis: dims.setdefault(dim, torch.export.Dim(dim)) for axis, dim in axes.items()}
        for name, axes in dynamic_axes.items()
    }
    # The exporter names intermediate values after the aten op that makes them, so an
    # output called "embedding" collides with the embedding lookup's value: export under a
    # name no op has, then rename.
    scratch_name = f"{output_name}__output"
    with warnings.catch_warnings():
        # Known noise: axis renaming notices and a torch-internal deprecation.
        warnings.filterwarnings("ignore", message=".*axis name", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        quiet_exporter()
        program = torch.onnx.export(
            module,
            example_inputs,
            input_names=list(input_names),
            output_names=[scratch_name],
            dynamic_shapes=shapes,
            opset_version=OPSET,
            dynamo=True,
            verbose=False,
        )
    model = program.model_proto
    _rename_value(model, output_name, f"{output_name}__internal")
    _rename_value(model, scratch_name, output_name)
    # Batch first, always: the encoder checks one output row per input against it.
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx.checker.check_model(model, full_check=True)
    # One file, weights inline: a 90 MB model is far below protobuf's 2 GB limit, and a
    # single file cannot be half-copied alongside a stale weights file.
    onnx.save_model(model, str(path), save_as_external_data=False)


def _rename_value(model: Any, old: str, new: str) -> None:
    """Rename every use of the value ``old`` in the main graph (inputs, outputs, nodes)."""
    graph = model.graph
    for node in graph.node:
        node.input[:] = [new if v == old else v for v in node.input]
        node.output[:] = [new if v == old else v for v in node.output]
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.name == old:
            value.name = new


def quantize_int8(src: Path, dst: Path) -> None:
    """Write an int8 copy of ``src``: weights of constant MatMuls as int8 per output
    channel, activations quantized per batch at run time (dynamic quantization).

    Per-channel matters here: per-tensor scales took MiniLM's mean cosine to fp32 down to
    0.95, per-channel keeps it above 0.99 (measured on ``FIDELITY_SENTENCES``). Activation
    scales are chosen per call over the whole batch, so a row's result depends slightly on
    its batch-mates; the build records how much (``batch_vs_alone_min_cosine``).
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet_quantizer():
        quantize_dynamic(
            str(src),
            str(dst),
            weight_type=QuantType.QInt8,
            per_channel=True,
            # Only MatMuls whose weights are constants: quantizing the attention products
            # (activation x activation) costs accuracy for little speed.
            extra_options={"MatMulConstBOnly": True},
        )
