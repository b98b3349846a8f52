"""The settings sections of the serving policies: request limits, the encoders' batching and
precision, routing, caching, video, admission, generation, assembly, the DLQ and quotas.
``schemas.settings`` gathers them into ``Settings``; read that module's docstring first.
"""

from __future__ import annotations

import math
import re

from pydantic import field_validator, model_validator

from schemas.request import MODALITY_NAME_RE
from schemas.settings_base import (ENGINE_PRECISIONS, TASKS, EnginePrecision, GeneratorPrecision, Grouping, QueueOrder, Partitioner,
                                   Scheduler, Section, csv_items, parse_assignments, setting, whole_number)


class LimitsSettings(Section):
    max_text_bytes: int = setting(64 * 1024, "Largest text part, UTF-8 bytes.", ge=1)
    max_parts: int = setting(16, "Most parts in one request.", ge=1)
    max_inline_bytes: int = setting(
        1024 * 1024, "Largest inline binary part; bigger payloads must travel by `ref`.", ge=1
    )
    max_request_bytes: int = setting(
        4 * 1024 * 1024, "Largest encoded request on ingress; larger ones go to the DLQ.", ge=1
    )
    default_deadline_ms: int = setting(
        30_000, "Deadline given to requests that set none, milliseconds from acceptance.", ge=1
    )
    max_deadline_ms: int = setting(600_000, "Longest deadline a client may ask for.", ge=1)
    max_ref_bytes: int = setting(
        64 * 1024 * 1024, "Largest payload fetched by one claim check (ref), at its stored size: the router sizes every ref "
        "at admission (STRLEN, the file's size) and fails a larger part with payload_too_large; the worker then reads "
        "at most the size priced.", ge=1
    )
    max_request_ref_bytes: int = setting(
        64 * 1024 * 1024, "Most bytes the refs of one request may name together, at their stored size (the same blob "
        "named by 16 parts counts 16 times); over it the request is payload_too_large.", ge=1
    )
    ref_file_root: str = setting(
        "", "Directory whose files may be sent as file:// refs, one subdirectory per tenant (a tenant's refs resolve "
        "only under <root>/<tenant>/); empty: file refs are refused."
    )
    claim_ttl_s: int = setting(
        3600, "How long the SDK keeps a claim-checked payload in Redis; the router also caps the remaining life of "
        "every claim check a request names at this (one stored without an expiry gets one).", ge=1
    )
    max_audio_seconds: float = setting(300.0, "Longest audio clip accepted (decoded duration).", gt=0)
    max_image_pixels: int = setting(
        25_000_000, "Largest image (width x height, read from the header before decoding): the decompression-bomb guard.", ge=1
    )


class EncoderSettings(Section):
    max_batch_size: int = setting(16, "Most items in one engine call; bigger batches raise throughput and latency.", ge=1)
    max_wait_ms: float = setting(
        4.0, "How long the first item of a batch waits for company before the batch runs anyway.", ge=0
    )
    max_batch_ms: float = setting(
        60.0, "Engine time one batch may take, predicted by the stage's learned batch cost model: bounds how long a "
        "batch holds the engine (and so the wait of what arrives meanwhile).", gt=0
    )
    grouping: Grouping = setting(
        "length", "Which queued items ride together: length (similar padded lengths, so a long text never pads short "
        "ones) or fifo (arrival order, as a generic server). An engine that runs rows alone (int8 text) pads nothing "
        "and always takes them in arrival order."
    )
    order: QueueOrder = setting(
        "fair", "In which order a lane's queued items reach the engine: fair (tenants share engine time by predicted "
        "cost, start-time fair queuing: one tenant's backlog cannot hold another's items behind it) or arrival."
    )
    intra_op_threads: int = setting(
        1, "ONNX Runtime intra-op threads per engine; 0 lets the runtime choose (one per core). One is the measured "
        "best on a small box, where every stage, the broker and Redis share the cores (docs/capacity.md).", ge=0
    )
    allow_spinning: bool = setting(
        False, "Let ONNX Runtime threads spin between ops: a little faster alone, much slower on a shared box."
    )
    precision: EnginePrecision = setting(
        "int8", f"Encoder variant to serve: one of {', '.join(ENGINE_PRECISIONS)} (the variant must be built and pass its "
        "fidelity gate, else the engine falls back to fp32). int8 measured 2.4x less CPU per text than fp32 at mean "
        "cosine 0.993 to it on real sentences (docs/capacity.md)."
    )
    heavy_prep_ms: float = setting(
        50.0, "A job whose preparation (an image's decode and resize) the router priced over this many ms is prepared "
        "on a thread of its own at lower CPU priority (heavy_prep_nice): a pixel-bound picture no longer holds the "
        "light jobs' preparation behind it, and yields to the encoder's other threads (nice acts within the process; "
        "between processes the kernel shares cores per autogroup or cgroup). Heavy jobs take that thread one at a time "
        "in tenant-fair order of their price. 0: every job on the one prep thread.",
        ge=0
    )
    heavy_prep_nice: int = setting(
        10, "How much lower that thread's CPU priority is (Linux nice, 1-19; 10 gives it about a tenth of a core "
        "that other work wants, all of an idle one).", ge=1, le=19
    )
    heavy_prep_process: bool = setting(
        True, "Where a modality can (images), that thread hands the decode to a process of its own that leads its own "
        "session at heavy_prep_nice (workers/offload.py): the kernel shares the cores between sessions or cgroups "
        "before it looks at a thread's nice, so only a process of its own yields the core to the other stages (the "
        "router encoding another tenant's texts), and a decode that kills its process does not kill the worker. "
        "false: the decode runs on the thread itself."
    )
    max_wait_rt_ms: float = setting(
        400.0, "The most the rt job of a one-part request waits in an encoder's engine queue (the router's own "
        "encoders' included) while that queue stands: once the queue has held work without a break for a second "
        "(the stage is past its capacity, not draining a burst), a job that waited past this is answered overloaded "
        "with retry_after_ms when the next batch is picked, instead of run late. Admission bounds the wait it "
        "predicts (admission.max_queued_ms_rt, 500); this bounds the wait that happens when the prediction runs "
        "short (a box past capacity, its cores shared with the other stages), as a model server's queue timeout "
        "does. Below admission's limit on purpose: in a standing queue the router's backlog, the batch and the "
        "assembler share the rest of a 1 s rt budget. A burst the engine drains within the second (200 texts at once "
        "on an idle box) is answered whole, as admission admitted it, so in the first second of a standing queue a job "
        "may wait up to that second (CoDel's interval: streams/cores/encoder.py STANDING_QUEUE_S; a queue that only "
        "refusals emptied still stands). "
        "Counted on the replica's own clock "
        "from the moment the job, prepared, joined the queue: its own decode (a cold one, a heavy one's turn) is no "
        "wait. A part of a request of several and a video's chunk are not bounded (they wait for their siblings too; "
        "refused alone a part would leave its request a partial answer). Measured at 1.5x and 2x capacity "
        "(docs/capacity.md, \"Stop 54\", \"Stop 55\"). 0: no bound.", ge=0
    )
    max_queue: int = setting(256, "Most jobs held in a worker between Kafka and the engine.", ge=1)
    max_queue_bytes: int = setting(
        256 * 1024 * 1024, "Most payload bytes the jobs held in a worker carry (inline data and text, and refs at the "
        "size priced, which the worker fetches): past it the worker polls nothing until jobs are answered, so 256 jobs "
        "of large refs cannot hold gigabytes. A single job larger than this is still taken when nothing is held.",
        ge=1024 * 1024
    )
    calibration_max_age_s: float = setting(
        86_400.0, "A replica reuses the batch timings another replica of the same engine measured on this machine "
        "(state_dir/calibration) if younger than this, instead of timing them again before it is ready: a cold start "
        "costs no calibration. 0 times them at every start. The cost model refits on live batches either way.", ge=0
    )
    providers: str = setting(
        "tensorrt,cuda,cpu", "ONNX Runtime execution providers, tried in order (tensorrt, cuda, cpu or full names); "
        "those this onnxruntime build lacks are skipped. Without cuda, Whisper stays on the CPU too.", min_length=1
    )


def _nice(raw: str) -> int:
    """A nice increment, 1-19; raises ``ValueError``."""
    n = whole_number(raw, 1)
    if n > 19:
        raise ValueError(raw)
    return n


def _ms(raw: str) -> float:
    """A bound in ms, finite and >= 0; raises ``ValueError``."""
    ms = float(raw)
    if not math.isfinite(ms) or ms < 0:
        raise ValueError(raw)
    return ms


COLOCATE_MAX_QUEUED_MS = 25.0
"""``router.colocate_max_queued_ms`` of a placed modality its pairs do not name."""


class RouterSettings(Section):
    served_modalities: str = setting(
        "", "Comma-separated modalities with an encoder pool (empty: every registered one); parts of others fail "
        "with unsupported_media."
    )
    served_tasks: str = setting(
        "embed,generate,retrieve", "Comma-separated tasks this deployment answers (retrieve needs the indexing "
        "and retrieve stages)."
    )
    topic_cache_s: float = setting(10.0, "How long the router trusts its list of existing reply topics.", ge=0)
    max_record_age_ms: float = setting(
        60_000.0, "How far back an ingress record's timestamp (the client's) is believed when timing the request: an "
        "older one counts as this old and one from the future as now, so a client cannot skew the queue and e2e "
        "metrics alerts read. Lag past it shows in consumer lag (lagmon).", ge=0,
    )
    modality_topics: bool = setting(
        True, "One encode topic and pool per modality; off, every part goes to one shared topic and generic pool "
        "(the no-routing baseline: light text waits behind video)."
    )
    partitioner: Partitioner = setting(
        "least-loaded", "How a job's partition inside a pool is chosen: least-loaded, spread, hash or round-robin."
    )
    colocate: str = setting(
        "text,image", "Comma-separated modalities whose encoder also runs inside each router process (placement): "
        "their parts skip the broker hop to the pool while that encoder has room and the part is small (see "
        "colocate_max_queued_ms, colocate_max_part_ms; with colocate_pool on it also reads the pool's topics). Empty: "
        "every part goes through its encode topic. Images run below the router's own work (colocate_nice)."
    )
    colocate_pool: bool = setting(
        False, "The router's own encoders also join their modality's pool and read its topics like any replica (a "
        "deployment with no such pool is then served by the routers alone). Off (the default): they take only the "
        "router's hand-overs, so no part of another request (another tenant's long text, from the topic) is encoded "
        "in the process that routes every request, and the pool must be deployed. Off measured better for the "
        "tenant beside a flooding one at the same capacity (docs/isolation.md)."
    )
    answer_local: bool = setting(
        True, "An embed request with one part that the router's own encoder takes (colocate: a short text or a small "
        "image by default) is answered by the router, with a done marker of its own, instead of through the "
        "assembler: one broker hop and one process fewer. Off: the assembler answers every embed request."
    )
    colocate_nice: str = setting(
        "image=10", "Per modality placed in the router (colocate), how much lower (Linux nice, 1-19) the CPU priority "
        "of its encoder's engine and preparation threads is than the router's record loop and its other threads, as "
        "modality=nice pairs: that encoder then takes what the intake of every request leaves (image=10 by default: "
        "the router's loop and its text engine go first). Empty: all at the process's priority."
    )
    step_back_rate: float = setting(
        5.0, "For a router run ahead of the others for the CPU (local.nice, e.g. router=-10): capacity refusals "
        "(requests admission refuses as overloaded because a stage's queued work is past its lane's limit; a tenant's "
        "quota sheds do not count) within one second at which it steps back to the level of the other processes: "
        "past the box's capacity its work grows with what arrives, and ahead of the pools it would take the cores the "
        "admitted requests wait for. 0: it never steps back.", ge=0
    )
    step_back_hold_s: float = setting(
        5.0, "How long a router that stepped back (step_back_rate) stays back after the last second with that many "
        "capacity refusals.", ge=0
    )
    colocate_max_queued_ms: str = setting(
        "25", "Predicted work (ms) queued ahead of a part past which the router's own encoder is passed over and the "
        "part goes through its encode topic to the whole pool: one number for every placed modality, or modality=ms "
        "pairs (a modality not named: 25); 0: only while that encoder is idle. Higher keeps more parts in the "
        "router, off the two hops and the assembler a part sent on costs: measured at 80 on a 2-core box, less CPU "
        "per request at capacity, and a longer admitted tail past capacity and beside a flooding tenant "
        "(docs/capacity.md, \"Stop 50\")."
    )
    large_record_bytes_per_s: float = setting(
        2.0 * 1024 * 1024, "Where each tenant has its own ingress topics (an authenticating broker): bytes of large "
        "records (over large_record_bytes) the router reads of one tenant per second while another tenant's records "
        "are coming too; past it that tenant's topics wait (its requests queue in its own topics) instead of the "
        "others' records waiting behind its bytes on the router's one fetch connection (docs/isolation.md, "
        "\"Stop 51\"). Alone, a tenant's records are read as fast as they come. 0: no pacing.", ge=0
    )
    refused_per_s: float = setting(
        10.0, "Where each tenant has its own ingress topics: requests of one tenant the router refuses for that "
        "tenant's own quota (rate, queued work, ref bytes, compute) per second while another tenant's records are "
        "coming too; past it that tenant's topics wait until paid back, so a client that ignores retry_after_ms and "
        "keeps sending costs the router and the broker at most this many refusals a second, not the others' latency "
        "(docs/isolation.md, \"Stop 52\"). A client that waits as told is never held. 0: no such pacing.", ge=0
    )
    turn_records: int = setting(
        32, "Where each tenant has its own ingress topics: the most records of one tenant the router routes per turn "
        "of its loop; the rest wait in the router, that tenant's topics paused, and go in the next turns beside the "
        "others' new records, so a poll of one tenant's backlog (hundreds of records, after a hold or a restart) does "
        "not hold every other tenant's records behind all of it (docs/isolation.md, \"Stop 52\"). 0: a poll is "
        "routed whole.", ge=0
    )
    large_record_bytes: int = setting(
        256 * 1024, "A record over this many bytes counts against large_record_bytes_per_s (the capacity mix's photos "
        "are under 220 KB).", ge=0
    )
    colocate_max_part_ms: float = setting(
        25.0, "Predicted engine time (ms) of one part past which it never runs in the router's own encoder (a long "
        "text goes to the pool, not into the process that routes every tenant's requests).", ge=0
    )

    @field_validator("colocate_max_queued_ms", mode="before")
    @classmethod
    def _queued_bounds(cls, value: object) -> str:
        value = str(value).strip() if isinstance(value, (int, float, str)) else value
        if not isinstance(value, str):
            raise ValueError("a number of ms, or modality=ms pairs")
        if "=" in value:
            parse_assignments(value, _ms, "modality=ms with ms >= 0")
        else:
            try:
                _ms(value)
            except ValueError:
                raise ValueError(f"{value!r} is not a number of ms >= 0 nor modality=ms pairs") from None
        return value

    def max_queued_of(self, modality: str) -> float:
        """``colocate_max_queued_ms`` for the placed ``modality`` encoder."""
        value = self.colocate_max_queued_ms
        if "=" not in value:
            return _ms(value)
        return parse_assignments(value, _ms, "modality=ms").get(modality, COLOCATE_MAX_QUEUED_MS)

    @field_validator("colocate_nice")
    @classmethod
    def _nice_pairs(cls, value: str) -> str:
        parse_assignments(value, _nice, "modality=nice with nice 1-19")
        return value

    def nice_of(self, modality: str) -> int:
        """How much lower the placed ``modality`` encoder's threads run (``colocate_nice``; 0: not lowered)."""
        return parse_assignments(self.colocate_nice, _nice, "modality=nice").get(modality, 0)

    @field_validator("served_tasks")
    @classmethod
    def _known_tasks(cls, value: str) -> str:
        unknown = [v for v in csv_items(value) if v not in TASKS]
        if unknown:
            raise ValueError(f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(TASKS)}")
        return value

    @field_validator("served_modalities", "colocate")
    @classmethod
    def _modality_names(cls, value: str) -> str:
        # Which modalities exist is the registry's (plugins add some): here only their shape.
        bad = [v for v in csv_items(value) if not re.fullmatch(MODALITY_NAME_RE, v)]
        if bad:
            raise ValueError(f"{', '.join(map(repr, bad))} is not a modality name (lowercase letters and digits)")
        return value


class CacheSettings(Section):
    enabled: bool = setting(True, "Reuse encoder outputs from Redis; off, every part is computed.")
    cross_tenant: bool = setting(
        False, "Share cached outputs between tenants (same content, same answer); off, the tenant is in the key."
    )
    ttl_text_s: int = setting(3600, "How long a text embedding stays reusable.", ge=1)
    ttl_image_s: int = setting(3600, "How long an image (or video frame chunk) embedding stays reusable.", ge=1)
    whole_result: bool = setting(
        True, "Answer identical embed requests (same tenant, content and models) from the stored answer at the router."
    )
    ttl_result_s: int = setting(600, "How long a whole answer stays reusable.", ge=1)
    whole_result_max_bytes: int = setting(
        65_536, "Largest request (text characters and inline bytes, all parts) the router keys a whole answer for; "
        "bigger ones are not looked up (their parts are still reused at the encoders).", ge=0
    )
    timeout_ms: float = setting(50.0, "Redis socket timeout: past it a lookup counts as a miss and a failure.", gt=0)
    breaker_failures: int = setting(3, "Consecutive Redis failures that open the breaker (cache bypassed).", ge=1)
    breaker_cooldown_s: float = setting(10.0, "How long the breaker stays open before one trial call.", ge=0)
    ttl_overrides: str = setting(
        "", "Cache TTLs by modality, e.g. audio=7200,doc=60 (seconds); a modality not named keeps its own default "
        "(text and image: the two settings above)."
    )

    @field_validator("ttl_overrides")
    @classmethod
    def _ttls(cls, value: str) -> str:
        parse_ttl_overrides(value)
        return value

    def ttls(self) -> dict[str, int]:
        """``ttl_overrides`` as {modality: seconds}."""
        return parse_ttl_overrides(self.ttl_overrides)


class VideoSettings(Section):
    max_seconds: float = setting(120.0, "Longest video accepted; longer ones fail with payload_too_large.", gt=0)
    fps: float = setting(1.0, "Frames sampled per second of video.", gt=0)
    max_frames: int = setting(16, "Most frames sampled from one video: bounds its cost on the image pool.", ge=1)
    max_decoded_pixels: int = setting(
        2_000_000_000, "Most pixels the video stage decodes for one clip (width x height summed over every frame "
        "decoded, sampled or not; about 60 fps of 1080p for the 16 s that 16 frames at 1 fps take): the decode work one "
        "part may cost, whatever its timestamps say; past it the part is payload_too_large.", ge=1
    )
    frames_per_chunk: int = setting(
        4, "Frames per image-pool job: smaller chunks spread one video over more replicas.", ge=1
    )
    max_held: int = setting(
        8, "Most video jobs one video stage replica holds (decoding or waiting for its decode thread); past "
        "it the replica stops fetching until one is done, so the rest wait in the broker.", ge=1
    )


class AdmissionSettings(Section):
    enabled: bool = setting(True, "Admit by queued work per stage and lane; off, everything valid is accepted.")
    max_queued_ms_rt: float = setting(
        500.0, "The most an admitted rt request waits at a stage (ms of engine work ahead of it: the rt work queued "
        "there and the batch running; rt goes before bulk). Past it, new rt requests get overloaded with retry_after_ms.",
        ge=0
    )
    max_queued_ms_bulk: float = setting(
        2_000.0, "The most an admitted bulk request waits at a stage (ms of all the work queued there). Past it, new "
        "bulk requests get overloaded; bulk is shed first because it waits behind every rt request.", ge=0,
    )
    refresh_ms: int = setting(
        250, "How often the router reads the encoders' load reports (Redis) for admission and the least-loaded "
        "partitioner; between reads it adds what it routed itself, as if none of it were served yet. Encoders "
        "report every 250 ms; reading them as often keeps that guess to a quarter second of sends (at 1 s, 60 "
        "images/s of 8 ms counted 480 ms of phantom queue, nearly rt's whole 500 ms bound).", ge=1
    )
    backpressure_high_ms: float = setting(
        3_000.0, "Total queued work (ms) past which the router stops reading bulk ingress.", ge=0
    )
    backpressure_low_ms: float = setting(
        1_000.0, "Total queued work (ms) under which it reads bulk ingress again.", ge=0
    )
    rt_backlog_records: int = setting(
        100, "rt ingress records waiting at the router past which it stops reading bulk ingress (rt first).", ge=0
    )

    @model_validator(mode="after")
    def _hysteresis(self) -> "AdmissionSettings":
        if self.backpressure_low_ms > self.backpressure_high_ms:
            raise ValueError(f"backpressure_low_ms ({self.backpressure_low_ms:g}) must not exceed "
                             f"backpressure_high_ms ({self.backpressure_high_ms:g})")
        return self


class GeneratorSettings(Section):
    precision: GeneratorPrecision = setting(
        "q4_1", "LM variant: q4_1 (the packaged 4-bit GGUF on llama.cpp, many sequences per decode; falls back to fp32 "
        "when its fidelity gate fails or llama.cpp is missing), fp32 or int8 (the ONNX exports)."
    )
    threads: int = setting(
        0, "CPU threads of the llama.cpp engine (0: one per core). On a box shared with the broker, fewer can win.", ge=0
    )
    kv_cache_tokens: int = setting(
        8192, "KV cells the running sequences of the llama.cpp engine share; a sequence reserves prompt + max_tokens "
        "of them at admission and waits while they are taken.", ge=256
    )
    ttft_bound_ms: int = setting(
        1_000, "rt generate requests whose predicted time to first token exceeds this are answered overloaded at once, "
        "with retry_after_ms (bulk gets 10x); 0 admits everything.", ge=0
    )
    scheduler: Scheduler = setting("continuous", "continuous (step-level, sequences join and leave) or static batching.")
    max_tokens_per_step: int = setting(
        256, "Token budget of one model step (prefill chunks + one per decoding sequence).", ge=1
    )
    max_running: int = setting(8, "Most sequences holding KV state at once.", ge=1)
    max_prefill_chunk: int = setting(256, "Most prompt tokens of one sequence in one step (chunked prefill).", ge=1)
    stream_every_tokens: int = setting(1, "Send a token event every N tokens (fewer events, coarser streaming).", ge=1)
    prefix_cache_mb: int = setting(
        64, "Memory for reused prompt-prefix KV blocks; 0 turns the prefix cache off.", ge=0
    )
    max_queued: int = setting(
        64, "Most generate jobs one generator holds (running or waiting): past it, it stops fetching.", ge=1
    )
    done_retention_ms: int = setting(
        600_000, "How long a finished generation is remembered so a repeated job is not answered again.", ge=0
    )


class AssemblerSettings(Section):
    sweep_interval_ms: int = setting(
        100, "How often the assembler looks for requests past their deadline: the deadline's resolution.", ge=1
    )
    retention_ms: int = setting(
        120_000, "How long a finished request is remembered so late duplicates cannot answer it twice.", ge=0
    )
    orphan_ttl_ms: int = setting(
        5_000, "How long parts that arrived before their manifest wait for it (the router sends the manifest first, so "
        "only a reordering or a forged part waits): longer tolerates more reordering, holds forged parts longer.", ge=1
    )
    max_pending: int = setting(
        100_000, "Most requests one assembler tracks; past it new manifests are answered overloaded.", ge=1
    )
    max_orphans: int = setting(
        10_000, "Most parts without a manifest (forged or stale) one assembler keeps; past it the oldest are dropped.",
        ge=1
    )
    accepted_linger_ms: float = setting(
        50.0, "How long the assembler holds a request's accepted event in the hope of sending it with the answer: one "
        "produce and one client fetch instead of two for a request answered within it (an image encoded in the pool; "
        "a text the router encoded in process already comes whole). A request answered later gets its accepted event "
        "this much later. 0: at once.", ge=0
    )


class DlqSettings(Section):
    """The dead-letter topic: what it keeps of a record it parks, and for how long."""

    keep_payload: bool = setting(
        True, "Keep the record's value (cut to the size limit) in the DLQ copy; off, only its headers, the reason and "
        "the source: nothing a client sent stays on the DLQ, but a parked record cannot be replayed from it."
    )
    retention_ms: int = setting(
        3 * 24 * 3_600_000, "How long DLQ records are kept (the topic's retention.ms, set when it is created).", ge=60_000
    )
    tenant_rate_per_s: float = setting(
        20.0, "Records per second one tenant's ingress may park in the DLQ (per router replica; in plaintext mode "
        "every client counts as one); past it, and its burst, a bad record is counted (mmstream_dlq_dropped_total) and "
        "dropped unlogged. 0: no limit.", ge=0
    )
    tenant_burst: float = setting(200.0, "DLQ records a tenant may park at once above that rate.", ge=1)
    retention_bytes: int = setting(
        1024 ** 3, "Most bytes the DLQ keeps per partition (retention.bytes, set when it is created); the oldest go first.",
        ge=1024 * 1024,
    )


class QuotaSettings(Section):
    """Per-tenant limits at the router (``streams.policies.quota``): one tenant cannot take
    the whole pool. Each router replica counts on its own (a tenant's requests spread over
    the replicas by ingress partition), so the limits hold per replica."""

    rate_per_s: float = setting(
        0.0, "Requests per second one tenant may send (token bucket); 0: no rate limit. Over it: overloaded with "
        "retry_after_ms.", ge=0
    )
    burst: float = setting(0.0, "Requests a tenant may send at once above its rate; 0: one second's worth.", ge=0)
    overrides: str = setting(
        "", "Per-tenant rates, e.g. acme=50,batchco=5:20 (rate_per_s[:burst]); a tenant not named gets rate_per_s."
    )
    fair_share: float = setting(
        0.5, "While admission is turning some tenant away (overloaded, within window_ms), the largest share of a "
        "lane's queued-work limit (admission.max_queued_ms_<lane>) one other tenant's queued work may hold; a tenant "
        "alone, or among tenants that all get in, may use it all. 0: off.", ge=0, le=1,
    )
    max_queued_ms: float = setting(
        0.0, "Queued engine work (ms) one tenant may have, alone or not; 0: no such limit. A tenant's queued work is "
        "what the router sent for it, counted until its predicted end (queue wait + cost).", ge=0
    )
    window_ms: int = setting(
        10_000, "Longest time one job counts as a tenant's queued work, and how long a refused tenant makes the "
        "others keep to their fair share.", ge=100
    )
    ref_bytes_per_s: float = setting(
        64.0 * 1024 * 1024, "Bytes per second one tenant's refs may make the workers read (token bucket per router "
        "replica, refs at their stored size); 0: no byte limit. Over it: overloaded with retry_after_ms.", ge=0
    )
    ref_bytes_burst: float = setting(
        0.0, "Bytes a tenant's refs may name at once above that rate; 0: the larger of one second's worth and "
        "limits.max_request_ref_bytes (so one request at the cap always gets in eventually).", ge=0
    )
    compute_ms_per_s: float = setting(
        -1.0, "Predicted engine milliseconds per second one tenant's requests may cause (token bucket per router "
        "replica): every part's encode priced by its length or pixels, a generation by its prompt and max_tokens at "
        "the step cost the generators measured, as if it ran alone, times the CPU threads of their engine "
        "(streams/policies/gen_price.py). "
        "Bounds how much of the engines one tenant takes, queued or not; over it: overloaded with retry_after_ms. "
        "0: no compute limit. -1 (the default): 500 where the broker authenticates tenants (kafka.authenticated), "
        "none in plaintext mode, where a tenant is a name any client may give and a per-tenant limit bounds nothing.",
        ge=-1,
    )
    debt_nice: int = setting(
        10, "How much lower (nice) the generator runs while it holds a generation admitted over its tenant's compute "
        "bucket (in debt: compute_debt): the tenant paid for it over time, not to take the cores from everyone now. "
        "Nice is work-conserving: alone on the box it runs as fast. 0: not lowered.", ge=0, le=19
    )
    generation_shared_by: int = setting(
        1, "How many sequences the compute quota assumes share each generator step (its fixed cost split between "
        "them): 1 prices a generation as if it ran alone, what it costs on an idle generator and the most it can cost; "
        "a deployment whose chat traffic keeps the generator's batches full (generator.max_running) may say so and pay "
        "up to about half as much per token.", ge=1
    )
    compute_burst_ms: float = setting(
        0.0, "Engine milliseconds a tenant may cause at once above that rate; 0: two seconds' worth. A request priced "
        "over it waits for a full bucket and leaves it in debt.", ge=0
    )
    compute_debt: bool = setting(
        True, "A request priced over the compute burst is admitted on a full bucket and leaves it in debt (so every "
        "request the per-request bounds allow gets in eventually); false: it is refused as payload_too_large (field "
        "parts), so no one request costs more than the burst.",
    )
    produce_bytes_per_s: int = setting(
        8 * 1024 * 1024, "Bytes per second one tenant's clients may produce on a secured broker: `mmstream tenant add` "
        "sets it as the tenant principal's producer_byte_rate client quota, so the broker throttles a flooding tenant "
        "before its records reach the router. 0: none (one set before is removed).", ge=0
    )
    fetch_bytes_per_s: int = setting(
        0, "Bytes per second one tenant's clients may fetch (its answers) on a secured broker (consumer_byte_rate, set "
        "by `mmstream tenant add`); 0: none (one set before is removed).", ge=0
    )
    request_percentage: float = setting(
        0.0, "Share of the broker's request-handling threads one tenant's clients may keep busy, in percent of one "
        "thread (request_percentage, set by `mmstream tenant add`; the broker has num.network.threads + "
        "num.io.threads of them): past it the broker delays the tenant's responses, so a flood of requests, however "
        "small, costs the broker a bounded share. 0: none (one set before is removed).", ge=0
    )
    claim_bytes: int = setting(
        32 * 1024 * 1024, "Bytes of claim checks one tenant may keep in Redis; past it, the router's sweep deletes its "
        "newest ones (streams/policies/claim_quota.py). Keep it well under Redis's maxmemory (256 MiB locally): a "
        "tenant within it still evicts others' entries when all tenants together fill the server. 0: no byte quota "
        "(the TTL cap still holds).", ge=0
    )
    claim_sweep_s: float = setting(
        2.0, "How often each router sweeps the stored claim checks (TTL cap, per-tenant byte quota); 0: never.", ge=0
    )
    max_tenants: int = setting(10_000, "Most tenants whose counts the router keeps (memory bound; idle ones go).", ge=1)
    metric_tenants: int = setting(
        20, "Tenants named in the shed metric's tenant label (the first ones shed); the rest count as `other`.", ge=0
    )

    @field_validator("overrides")
    @classmethod
    def _rates(cls, value: str) -> str:
        parse_quota_overrides(value)
        return value


def parse_quota_overrides(value: str) -> dict[str, tuple[float, float]]:
    """``acme=50,batchco=5:20`` -> {tenant: (rate_per_s, burst)} (burst 0: one second's worth).
    Raises ``ValueError`` naming the bad item."""
    return parse_assignments(value, _rate_and_burst, "tenant=rate_per_s[:burst] with numbers >= 0")


def parse_ttl_overrides(value: str) -> dict[str, int]:
    """``audio=7200,doc=60`` -> {modality: seconds}. Raises ``ValueError`` naming the bad item."""
    return parse_assignments(value, lambda spec: whole_number(spec, least=1), "modality=seconds with seconds >= 1")


def _rate_and_burst(spec: str) -> tuple[float, float]:
    rate, _, burst = spec.partition(":")
    parsed = (float(rate), float(burst or 0))
    if min(parsed) < 0:
        raise ValueError(spec)
    return parsed
