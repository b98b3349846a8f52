"""The real SmolLM2-135M export: it answers, batching and the prefix cache change nothing.

Needs no broker: it builds the model into the machine's model repository (once per
machine; later runs find it up to date) and runs it on the CPU. Skips when the build
dependencies (torch, transformers, gguf, the model package) are absent. Latency is the
benches' to measure, not a test's: ``python -m mmstream.enginebench --model smollm2-135m``
(the engine alone, per precision) and ``mmstream bench --workload chat`` (TTFT and TPOT
through the pipeline).
"""

from __future__ import annotations

import time

import pytest

from schemas.settings import Settings
from streams.cores.generation import GenerationCore, GenerationRequest, GenerationUpdate
from streams.policies.scheduler import ContinuousBatchScheduler, SchedulerLimits, StaticBatchScheduler
from workers.engines.gate import check_variant
from workers.engines.lm import LMEngine, SamplingParams, StopChecker
from workers.models.build import ensure_built
from workers.models.smollm import NAME
from workers.prefix_cache import PrefixCache
from workers.prompt import PromptSettings, TextPart, build_prompt
from workers.repository import ModelConfig

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

SYSTEM = PromptSettings(system="You are a helpful assistant. Answer briefly.")
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea in exactly three lines, please, and nothing else at all.",
    "hi",
)


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return ensure_built(Settings.from_env().models.repository, NAME, log=print)


@pytest.fixture(scope="module")
def tokenizer(config: ModelConfig):
    return tokenizers.Tokenizer.from_file(str(config.tokenizer_path))


@pytest.fixture(scope="module")
def engines(config: ModelConfig) -> dict[str, LMEngine]:
    return {p: LMEngine.from_config(config, p, intra_op_threads=2) for p in ("fp32", "int8")}


def encode(tokenizer, question: str, settings: PromptSettings = SYSTEM) -> list[int]:
    return tokenizer.encode(build_prompt([TextPart(question)], settings), add_special_tokens=False).ids


def serve(engine: LMEngine, scheduler, prompts: dict[str, list[int]], params: SamplingParams,
          stops: StopChecker | None = None, arrivals: dict[str, int] | None = None) -> dict[str, GenerationUpdate]:
    """The generator stage's core without Kafka: requests arrive at their steps; each one's
    ending update (``token_ids``, ``finish_reason``)."""
    arrivals = arrivals or {}
    core = GenerationCore(engine, scheduler, stops, clock=lambda: 0.0)
    done, step = {}, 0
    while len(done) < len(prompts):
        for seq_id, ids in prompts.items():
            if arrivals.get(seq_id, 0) == step:
                core.submit(GenerationRequest(seq_id, tuple(ids), params, "rt", float(step)))
        for u in core.step():
            if u.finish_reason is not None:
                done[u.key] = u
        step += 1
    return done


def test_the_registry_serves_the_lm_through_the_engine_contract(config: ModelConfig, tokenizer) -> None:
    from workers.engines import Engine, EngineOptions, load_engine

    assert config.backend == "lm-onnxruntime"
    engine = load_engine(config, "fp32", EngineOptions(intra_op_threads=2))
    assert isinstance(engine, Engine)
    assert (engine.info.model, engine.info.backend, engine.info.precision) == (NAME, "lm-onnxruntime", "fp32")
    assert engine.info.provider != "TensorrtExecutionProvider"
    assert len(engine.warmup(1)) == 1
    prompt = encode(tokenizer, QUESTIONS[0])
    seq = engine.new_sequence("s", prompt, SamplingParams(max_tokens=1))
    assert engine.run([(seq, len(prompt))]).shape[0] == 1  # one logits row per chunk


def test_answers_the_capital_of_france(config: ModelConfig, engines: dict[str, LMEngine], tokenizer) -> None:
    """Every variant the generator would serve on this CPU. The dynamic int8 graph misses its
    gate on a CPU without VNNI (its u8s8 products saturate: teacher-forced agreement 0.20 on
    this box, 0.88 where it was introduced), and the generator then serves fp32 instead."""
    ids = encode(tokenizer, QUESTIONS[0])
    served = [p for p in engines if check_variant(config, p) is None]
    assert "fp32" in served
    for precision in served:
        answer = tokenizer.decode(engines[precision].generate_greedy(ids, 24))
        assert "Paris" in answer, (precision, answer)


def test_batched_equals_alone(engines: dict[str, LMEngine], tokenizer) -> None:
    """Different lengths, staggered arrivals, chunked prefill mixed with decodes: every
    sequence's greedy tokens are those it produces alone (fp32)."""
    engine = engines["fp32"]
    prompts = {f"q{i}": encode(tokenizer, q) for i, q in enumerate(QUESTIONS)}
    alone = {k: engine.generate_greedy(ids, 20) for k, ids in prompts.items()}
    scheduler = ContinuousBatchScheduler(
        SchedulerLimits(max_tokens_per_step=48, max_running=4, max_prefill_chunk=24),
        eos_token_ids=engine.eos_token_ids,
    )
    batched = serve(engine, scheduler, prompts, SamplingParams(max_tokens=20),
                    arrivals={"q0": 0, "q1": 0, "q2": 1, "q3": 3})
    assert {k: list(f.token_ids) for k, f in batched.items()} == alone


def test_int8_batch_drift_is_measured(config: ModelConfig, engines: dict[str, LMEngine], tokenizer) -> None:
    """Dynamic int8 picks activation scales per call over the whole batch, so a row can
    shift with its batch-mates (fp32 rows do not). Alone, the scheduler path is exact; in a
    batch of 4 the drift is printed, and the build records it in the int8 fidelity."""
    engine = engines["int8"]
    prompts = {f"q{i}": encode(tokenizer, q) for i, q in enumerate(QUESTIONS)}
    alone = {k: engine.generate_greedy(ids, 16) for k, ids in prompts.items()}
    one_at_a_time = ContinuousBatchScheduler(SchedulerLimits(max_tokens_per_step=512, max_running=1),
                                             eos_token_ids=engine.eos_token_ids)
    serial = serve(engine, one_at_a_time, prompts, SamplingParams(max_tokens=16))
    assert {k: list(f.token_ids) for k, f in serial.items()} == alone
    static = StaticBatchScheduler(SchedulerLimits(max_tokens_per_step=512, max_running=4),
                                  eos_token_ids=engine.eos_token_ids)
    batched = serve(engine, static, prompts, SamplingParams(max_tokens=16))
    agree = sum(_prefix(list(batched[k].token_ids), alone[k]) for k in alone)
    print(f"\nint8 batch of 4 vs alone: {agree}/{sum(map(len, alone.values()))} greedy tokens agree; "
          f"build fidelity {dict(config.variant('int8').fidelity)}")
    assert "batch_vs_alone_agreement" in config.variant("int8").fidelity


def test_prefix_cache_hit_equals_miss(config: ModelConfig, engines: dict[str, LMEngine], tokenizer) -> None:
    cache = PrefixCache(max_bytes=64 << 20, block_tokens=16, namespace=f"{NAME}/fp32")
    cached = LMEngine.from_config(config, "fp32", intra_op_threads=2, prefix_cache=cache)
    first, second = encode(tokenizer, QUESTIONS[0]), encode(tokenizer, QUESTIONS[1])
    miss = {q: engines["fp32"].generate_greedy(ids, 12) for q, ids in (("a", first), ("b", second))}
    assert cached.generate_greedy(first, 12) == miss["a"]  # fills the cache
    hits_before = cache.stats.hits
    assert cached.generate_greedy(second, 12) == miss["b"]  # shares the system prompt's blocks
    assert cached.generate_greedy(first, 12) == miss["a"]  # all but the last block reused
    assert cache.stats.hits >= hits_before + 2, cache.stats


def test_stop_strings_and_seeded_sampling(engines: dict[str, LMEngine], tokenizer) -> None:
    engine = engines["int8"]
    ids = encode(tokenizer, QUESTIONS[1])
    stops = StopChecker(tokenizer, engine.eos_token_ids)
    limits = SchedulerLimits(max_tokens_per_step=256, max_running=2)
    full = tokenizer.decode(engine.generate_greedy(ids, 30), skip_special_tokens=True)
    stop = full.split()[2]  # a word the greedy answer is known to contain
    params = SamplingParams(max_tokens=30, stop=(stop,))
    ended = serve(engine, ContinuousBatchScheduler(limits, engine.eos_token_ids), {"s": ids}, params, stops)["s"]
    assert ended.finish_reason == "stop" and ended.text == full[:full.index(stop)], (full, ended.text)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7)
    runs = [serve(engine, ContinuousBatchScheduler(limits, engine.eos_token_ids), {"r": ids}, params)["r"].token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_continuous_vs_static_batching(engines: dict[str, LMEngine], tokenizer) -> None:
    """Same requests (staggered arrivals, uneven lengths) through both schedulers: both
    finish everything; printed: model steps and wall time."""
    engine = engines["int8"]
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(8)]
    prompts = {f"r{i}": encode(tokenizer, q) for i, q in enumerate(questions)}
    arrivals = {f"r{i}": i for i in range(8)}
    limits = SchedulerLimits(max_tokens_per_step=256, max_running=4)
    for cls in (ContinuousBatchScheduler, StaticBatchScheduler):
        scheduler = cls(limits, eos_token_ids=())  # no eos: every request runs max_tokens
        start = time.perf_counter()
        done = serve(engine, scheduler, prompts, SamplingParams(max_tokens=12), arrivals=arrivals)
        assert all(f.finish_reason == "max_tokens" for f in done.values()) and len(done) == 8
        print(f"\n{cls.__name__}: 8 requests x 12 tokens in {time.perf_counter() - start:.2f} s")
