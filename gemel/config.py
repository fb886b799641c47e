"""The one typed configuration of gemel, loadable from YAML; every default serves."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Dtype = Literal["auto", "float32", "bfloat16", "float16"]

# Names stock SDK examples use; by default they all reach the default model.
DEFAULT_ALIASES = [
    "gemini-2.0-flash",
    "gemini-2.0-flash-001",
    "gemini-2.5-flash",
    "gemini-2.5-flash-lite",
    "gemini-1.5-flash",
    "gpt-4o-mini",
    "gpt-4o",
    "gpt-3.5-turbo",
    "gpt-3.5-turbo-instruct",
]
DEFAULT_EMBEDDING_ALIASES = [
    "text-embedding-004",
    "gemini-embedding-001",
    "embedding-001",
    "text-embedding-3-small",
    "text-embedding-ada-002",
]


class KVOffloadConfig(BaseModel):
    """Where prefix blocks evicted from the KV pool live on: host memory, then disk."""

    model_config = ConfigDict(extra="forbid")

    cpu_mb: int = Field(512, ge=0, description="host-memory tier; 0 = off")
    disk_dir: str | None = Field(None, description="disk tier directory (kept across restarts); null = off")
    disk_gb: float = Field(4.0, gt=0, description="size bound of the disk tier")


class EngineConfig(BaseModel):
    """Sizes and switches of one engine (one loaded model)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2-135m-instruct", description="GGUF file, HF directory, or packaged model name")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Dtype = Field("auto", description="auto: bf16 on CUDA, on CPUs with AMX, and on CPUs with AVX512-BF16 for checkpoints with dense weights; else float32 (with a GGUF's quantised blocks on the integer kernels)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    kv_cache_memory_mb: int = Field(2048, ge=1, description="memory budget for the KV cache")
    num_kv_blocks: int | None = Field(None, ge=1, description="overrides kv_cache_memory_mb when set")
    kv_cache_dtype: Literal["auto", "float16", "int8"] = Field(
        "auto",
        description="auto: the model's dtype, except float16 where the kernel plan computes in float32 on the "
        "integer kernels (dtype auto with a GGUF's quantised blocks on CPUs without AMX: half the bytes for decode "
        "attention to read, as llama.cpp's f16 default); float16: float16 keys and values under a float32 model (dtype float32 only); "
        "int8: each token's keys and values per KV head as int8 codes with one "
        "float32 scale (as llama.cpp's q8_0 cache): about half the bytes, so decode attention on CPU reads half the "
        "memory and twice the tokens fit; slightly different outputs",
    )
    max_num_seqs: int = Field(64, ge=1, description="most sequences running at once")
    max_num_batched_tokens: int = Field(512, ge=1, description="token budget of one step")
    max_model_len: int | None = Field(None, ge=1, description="context cap; default the model's own")
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    itl_target_ms: float | None = Field(
        50.0, gt=0, description="step-time target while requests decode; null: always the full budget"
    )
    cpu_isa: Literal["auto", "portable", "avx2", "avx512", "amx"] = Field(
        "auto",
        description="instruction-set level of the CPU kernels and of the kernel plan: auto = the CPU's own; a "
        "lower level runs what CPUs of that class run (e.g. avx2 on an AVX-512 machine, to measure that plan); "
        "a level the CPU lacks is refused. $GEMEL_CPU_ISA caps it for a whole process",
    )
    weight_quant: Literal["auto", "none", "checkpoint", "int8", "int4"] = Field(
        "auto",
        description="low-bit copies of the projections (CPU): checkpoint = the GGUF's own groups (Q4_0, Q4_1, "
        "Q4_K, Q5_0, Q8_0), exact; int8/int4 = re-quantised, lossy; none = the dense weights. auto = checkpoint: "
        "in bf16 as weight-only copies for small decode batches; in float32 chosen by dtype auto (a CPU without "
        "native bf16) for every call with x rounded to int8 (int8_activations, llama.cpp's arithmetic); a "
        "float32 asked for by name keeps the dense weights and their exact sums",
    )
    int8_activations: bool = Field(
        False,
        description="calls with more rows than the weight-only kernels take (large decode batches, prefill) on the "
        "checkpoint's own weight groups (GGUF Q4_0/Q4_1/Q8_0) with x rounded to int8 per group of 32, llama.cpp's "
        "arithmetic: faster than bf16 on AVX512-VNNI CPUs without AMX and than float32 on AVX2 CPUs, slightly "
        "different outputs (CPU)",
    )
    int8_act_max_rows: int | None = Field(
        None,
        ge=1,
        description="with int8_activations, calls of more rows take the bf16 GEMM instead; default 128 on CPUs with "
        "AMX (whose bf16 tiles win on prefill-sized calls while the 4-bit weights stream faster in decode steps), "
        "no limit elsewhere",
    )
    amx_max_rows: int | None = Field(
        None,
        ge=0,
        description="on CPUs with AMX-BF16 (bf16 weights), calls of more rows than the weight-only kernels take and "
        "up to this many take gemel's AMX tile kernel on a copy of each projection in the tiles' layout (same bf16 "
        "arithmetic as oneDNN's GEMM, faster at decode batch sizes); default 128 there, 0 turns it off; "
        "with it, int8_activations only serves calls of more rows than this",
    )
    packed_max_rows: int | None = Field(
        None,
        ge=0,
        description="use the packed low-bit kernels up to this many rows; default 8 where gemel's "
        "AVX512-VNNI kernel serves the 4-bit groups, else 4 (PyTorch's kernels lose beyond that)",
    )
    memory_allocator: Literal["auto", "system"] = Field(
        "auto",
        description="the engine process's malloc: auto preloads jemalloc where the system (or Ray's wheel) has it, "
        "fewer cycles per tensor a step makes; system keeps the C library's (a served engine process only)",
    )
    cpu_attention_kernel: bool = Field(
        True,
        description="decode and prefill attention through a C++ kernel that reads the paged KV cache in place (CPU; "
        "built with the system C++ compiler on first use and cached; the PyTorch path where it cannot be built)",
    )
    cpu_fused_ops: bool = Field(
        True,
        description="RMSNorm, SiLU-and-mul and the rotary embedding as fused C++ ops in eager steps (CPU, "
        "Llama-family models; built with the other C++ kernels; the PyTorch ops where they cannot be built)",
    )
    compile: bool = Field(
        False,
        description="torch.compile the forward pass of decode-only steps of up to compile_max_batch_size "
        "sequences (fuses the small ops that dominate small batches on CPU); compiled at start-up",
    )
    compile_max_batch_size: int = Field(8, ge=1, description="largest decode batch that takes the compiled path")
    compile_cpp_wrapper: bool = Field(
        False,
        description="compiled steps call their generated kernels from C++ instead of Python (inductor's "
        "cpp_wrapper): ~8% off a CPU decode step at batch 1, but the first start-up compiles twice as long",
    )
    speculative_method: Literal["none", "ngram", "draft_layers"] = Field(
        "none", description="speculative decoding proposer: n-gram prompt lookup or the target's first layers"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per step")
    ngram_max: int = Field(4, ge=1, description="longest suffix the n-gram proposer matches")
    draft_layers: int = Field(8, ge=1, description="layers of the target used as the self-speculative draft")
    num_threads: int | None = Field(None, ge=1, description="CPU threads; unset: all cores (under gemel serve, one fewer while other processes keep them busy)")
    seed: int = Field(0, description="seed of the generator shared by unseeded sampling requests")
    kv_offload: KVOffloadConfig | None = Field(
        default_factory=KVOffloadConfig,
        description="tiers behind the prefix cache: evicted blocks kept in host memory and on disk; null = off",
    )
    fault_injection: str | None = Field(
        None,
        description="testing only, honoured when $GEMEL_FAULT_INJECTION=1: 'crash_after_steps=N' or "
        "'stall_after_steps=N' makes the first engine process die or hang after N steps",
    )


class ModelEntry(BaseModel):
    """One generative model of the catalogue; each runs in its own engine process."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="the name clients use (`models/<id>` on the Gemini surface)")
    source: str = Field(description="GGUF file, HF directory, or packaged model name")
    aliases: list[str] = Field(default_factory=list, description="other names that reach this model")
    version: str = Field("1", description="sent as modelVersion / x-model-version")
    display_name: str | None = None
    description: str = ""
    max_context: int | None = Field(None, ge=1, description="context cap; default the engine's / the model's own")
    max_output_tokens: int = Field(4096, ge=1, description="largest maxOutputTokens / max_tokens accepted")
    dtype: Dtype | None = Field(None, description="overrides engine.dtype for this model")


class EmbeddingModelEntry(BaseModel):
    """The embedding model served by embedContent / batchEmbedContents / /v1/embeddings."""

    model_config = ConfigDict(extra="forbid")

    id: str = "all-minilm-l6-v2"
    source: str = Field("all-minilm-l6-v2", description="BERT sentence-transformers directory or packaged name")
    aliases: list[str] = Field(default_factory=lambda: list(DEFAULT_EMBEDDING_ALIASES))
    version: str = "1"
    display_name: str | None = None
    max_batch: int = Field(100, ge=1, description="most texts in one request (Gemini's own limit is 100)")
    num_threads: int = Field(1, ge=1, description="CPU threads of the front-end process for embeddings")


class ServerConfig(BaseModel):
    """The HTTP listener and request-level limits of ``gemel serve``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    request_timeout_s: float = Field(600.0, gt=0, description="default deadline of a request")
    max_request_timeout_s: float = Field(3600.0, gt=0, description="largest deadline a client may ask for")
    max_body_mb: float = Field(
        20.0, gt=0, description="largest request body (Gemini's own inline limit); a larger one is refused with 413"
    )
    max_json_depth: int = Field(
        64, ge=2, le=500, description="deepest nesting of arrays and objects in a JSON body; deeper is a 400"
    )
    max_json_values: int = Field(
        1_000_000, ge=1000, description="most values (array items, object members) in a JSON body; more is a 400"
    )
    engine_ready_timeout_s: float = Field(
        300.0, gt=0, description="how long a request waits for a model that is still loading"
    )
    engine_stale_after_s: float = Field(
        60.0, gt=0, description="/readyz fails when the engine has not reported for this long"
    )
    stats_interval_s: float = Field(0.5, gt=0, description="how often an idle engine process reports its stats")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    engine_stall_s: float = Field(
        30.0, gt=0, description="an engine with queued work and no finished step for this long is restarted"
    )
    engine_max_restarts: int = Field(
        5, ge=0, description="restarts of a model's engine within engine_restart_window_s before it is marked failed; 0: never restart"
    )
    engine_restart_window_s: float = Field(300.0, gt=0, description="the window engine_max_restarts counts in")
    ssl_certfile: str | None = Field(
        None, description="PEM certificate chain; with ssl_keyfile the HTTP port speaks HTTPS only"
    )
    ssl_keyfile: str | None = Field(None, description="PEM private key of ssl_certfile")
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM/SIGINT, how long running requests may take to finish before the server stops",
    )
    verify_weights: Literal["off", "fast", "full"] = Field(
        "fast",
        description="check each model's weight files (SHA-256 against its package's RECORD or a path's manifest) "
        "before its engine starts; a model that fails is refused (503) while the others serve. fast: hash on first "
        "sight and when a file's size or mtime changed, else trust the cached result; full: hash on every start",
    )

    @field_validator("verify_weights", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false


class ObservabilityConfig(BaseModel):
    """Metrics, tracing, the dashboard and the periodic stats log."""

    model_config = ConfigDict(extra="forbid")

    log_stats_interval_s: float = Field(
        10.0, ge=0, description="period of the one-line stats log (only logged after activity); 0 disables it"
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint, e.g. http://localhost:4318/v1/traces; null: no export (default)",
    )
    otlp_headers: dict[str, str] = Field(default_factory=dict, description="extra headers sent to the OTLP endpoint")
    service_name: str = Field("gemel", description="OpenTelemetry service.name of exported spans")
    trace_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="share of new traces recorded (a caller's sampled flag is always followed)"
    )
    trace_memory_exporter: bool = Field(
        False, description="testing only: keep finished spans in memory and expose them at /internal/traces"
    )
    dashboard: bool = Field(True, description="serve the live dashboard at /dashboard")
    token_timeline_size: int = Field(
        20000, ge=100, description="recent output tokens kept for the dashboard's per-token latency heatmap"
    )


class QueueLimits(BaseModel):
    """Requests of each priority class that may wait for their first token at once (admission control)."""

    model_config = ConfigDict(extra="forbid")

    P0: int = Field(256, ge=0, description="critical")
    P1: int = Field(256, ge=0, description="standard")
    P2: int = Field(256, ge=0, description="batch")


class GatewayConfig(BaseModel):
    """Tenants, keys, rate limits and admission (``gemel.gateway``)."""

    model_config = ConfigDict(extra="forbid")

    tenants_file: str | None = Field(
        None,
        description="tenants YAML (gemel keys writes it); relative paths are relative to this config file. "
        "null: one anonymous tenant, loopback only",
    )
    insecure: bool = Field(False, description="allow unauthenticated serving on a non-loopback address")
    queue_limits: QueueLimits = Field(default_factory=QueueLimits)
    queue_retry_after_s: float = Field(1.0, gt=0, description="Retry-After of a 503 when a class queue is full")
    public_paths: list[str] = Field(
        default_factory=lambda: ["/healthz", "/readyz", "/metrics", "/docs", "/redoc", "/openapi.json"],
        description="paths served without credentials (and without limits)",
    )
    reload_interval_s: float = Field(1.0, gt=0, description="how often the tenants file is checked for changes")
    redis_url: str | None = Field(
        None,
        description="redis://host:port/db holding the rate limits' token buckets, shared by every front end and "
        "replica; null: each process keeps its own",
    )
    redis_unavailable: Literal["local", "deny"] = Field(
        "local",
        description="when Redis cannot be reached: local (each front end enforces the limits on its own) or deny "
        "(503 with Retry-After for requests that need a limit)",
    )


class GrpcConfig(BaseModel):
    """The Gemini gRPC listener of ``gemel serve``, optionally with TLS (``gemel.api.grpc_server``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="serve google.ai.generativelanguage.v1beta.GenerativeService over gRPC")
    host: str | None = Field(None, description="listen address; null: the same as server.host")
    port: int = Field(50051, ge=0, le=65535, description="listen port (0 picks a free one)")
    tls_cert_file: str | None = Field(None, description="PEM certificate chain; with tls_key_file the port speaks TLS")
    tls_key_file: str | None = Field(None, description="PEM private key of tls_cert_file")
    max_message_mb: int = Field(64, ge=1, description="largest request or response message")
    reflection: bool = Field(True, description="serve gRPC server reflection (grpcurl, grpcui)")

    @model_validator(mode="after")
    def _tls_pair(self) -> GrpcConfig:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("grpc.tls_cert_file and grpc.tls_key_file go together: set both or neither")
        return self


class RouteTarget(BaseModel):
    """One catalogue model behind a route, with its share of the route's requests."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the id of a generative catalogue model")
    weight: float = Field(ge=0, description="relative share of the route's requests (0: none)")
    canary: bool = Field(False, description="judged against the route's slo; rolled back (weight 0) when it breaks it")


class RouteSLO(BaseModel):
    """What a canary target must keep over its last ``window`` requests."""

    model_config = ConfigDict(extra="forbid")

    ttft_p99_ms: float | None = Field(None, gt=0, description="p99 time to the first output, ms; null: not judged")
    error_rate: float | None = Field(None, ge=0, le=1, description="share of 5xx / engine errors; null: not judged")
    window: int = Field(50, ge=1, description="the canary's last N requests are judged, once N have been seen")


class RouteConfig(BaseModel):
    """A public model name over weighted catalogue models (``gemel.gateway.routes``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the model name clients call; must not be a catalogue id or alias")
    targets: list[RouteTarget] = Field(min_length=1)
    sticky: Literal["none", "tenant", "user"] = Field(
        "none", description="tenant / user (OpenAI `user` field or x-gemel-user header): one target per key"
    )
    slo: RouteSLO | None = Field(None, description="judged on canary targets; ttft_p99_ms also bounds the predicted TTFT")
    fallback: str | None = Field(None, description="a generative model id, serving when the chosen target cannot in time")

    @model_validator(mode="after")
    def _targets(self) -> RouteConfig:
        models = [t.model for t in self.targets]
        if len(set(models)) != len(models):
            raise ValueError(f"route {self.name!r}: a model appears twice in its targets")
        if sum(t.weight for t in self.targets) <= 0:
            raise ValueError(f"route {self.name!r}: at least one target needs a weight above 0")
        return self


class SemanticCacheConfig(BaseModel):
    """Answers for near-duplicate prompts, for the tenants that opt in (``gemel.cache.semantic``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="look up the nearest earlier prompt by its embedding (needs faiss-cpu)")
    threshold: float = Field(0.95, gt=0, le=1, description="least cosine similarity of the prompt embeddings for a hit")
    tenants: list[str] = Field(
        default_factory=list,
        description="tenant ids or route names that opt in (a near-duplicate question is not the same question)",
    )


class ResponseCacheConfig(BaseModel):
    """Finished answers of deterministic requests, replayed without the engine (``gemel.cache``)."""

    model_config = ConfigDict(extra="forbid")

    exact: bool = Field(True, description="answer a request equal to an earlier one of the same tenant from the cache")
    semantic: SemanticCacheConfig = Field(default_factory=SemanticCacheConfig)
    ttl_s: float = Field(600.0, gt=0, description="how long an answer is kept")
    max_entries: int = Field(10000, ge=1, description="most answers kept; the least recently used go first")
    backend: Literal["memory", "redis"] = Field(
        "memory", description="memory: each front end keeps its own; redis: shared by every front end"
    )
    redis_url: str | None = Field(None, description="redis://host:port/db of the redis backend; null: gateway.redis_url")

    @model_validator(mode="after")
    def _packages(self) -> ResponseCacheConfig:
        from importlib.util import find_spec

        if self.semantic.enabled and find_spec("faiss") is None:
            raise ValueError("cache.response.semantic needs the faiss-cpu package: pip install 'gemel[cache]'")
        if self.backend == "redis" and find_spec("redis") is None:
            raise ValueError("cache.response.backend redis needs the redis package: pip install 'gemel[cache]'")
        return self


class CacheConfig(BaseModel):
    """Caches in front of the engines; ``response: null`` (the default) turns the response cache off."""

    model_config = ConfigDict(extra="forbid")

    response: ResponseCacheConfig | None = None


class ScaleConfig(BaseModel):
    """Each generative model on several engine replicas through Ray Serve (``gemel.scale``,
    docs/scaling.md). One replica, the default, runs the engine in-process as always, without Ray."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(1, ge=1, description="engine replicas per generative model; above 1 they run on Ray Serve")
    min_replicas: int | None = Field(None, ge=1, description="autoscaling: fewest replicas (with max_replicas)")
    max_replicas: int | None = Field(None, ge=1, description="autoscaling: most replicas")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="autoscaling: ongoing requests per replica Ray Serve scales towards"
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="autoscaling: load above target this long adds replicas")
    downscale_delay_s: float = Field(600.0, ge=0, description="autoscaling: load below target this long removes replicas")
    ray_address: str | None = Field(
        None, description="join this Ray cluster (e.g. ray://head:10001 or head:6379); null: start a local Ray instance"
    )
    engine_threads: int | None = Field(
        None, ge=1, description="CPU threads of each replica's engine; null: engine.num_threads, else cores / most replicas"
    )
    num_cpus: float | None = Field(
        None, gt=0, description="Ray CPUs each replica reserves; null: cores / most replicas (on a cluster: its engine threads)"
    )
    routing: Literal["prefix", "round_robin"] = Field(
        "prefix", description="prefix: the replica whose prefix cache holds the prompt's start, load-bounded; round_robin: in turn"
    )
    load_margin_requests: int = Field(8, ge=0, description="prefix routing gives way when the preferred replica has more "
                                      "ongoing requests than the least loaded plus this (or plus load_margin_ratio of its load)")
    load_margin_ratio: float = Field(0.5, ge=0, description="see load_margin_requests")
    prefix_map_entries: int = Field(100_000, ge=1, description="block hashes the router remembers (least recent go first)")
    max_ongoing_requests: int = Field(256, ge=1, description="requests one replica takes at once; more wait in the front end")
    graceful_shutdown_s: float = Field(
        60.0, gt=0, description="a replica being removed finishes its requests this long; the rest resume on another"
    )
    attach: bool = Field(
        False, description="send to the replicas' Ray Serve application already running on the cluster at ray_address "
        "(KubeRay's RayService deploys it from gemel.scale.app:build and this same file) instead of deploying it"
    )

    @model_validator(mode="after")
    def _one_way(self) -> ScaleConfig:
        if self.attach and not self.ray_address:
            raise ValueError("scale.attach needs scale.ray_address: the cluster whose application it uses")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("scale.min_replicas and scale.max_replicas go together")
        if self.min_replicas is not None:
            if self.min_replicas > self.max_replicas:
                raise ValueError("scale.min_replicas is above scale.max_replicas")
            if self.replicas != 1:
                raise ValueError("scale: give replicas (a fixed count) or min_replicas/max_replicas (autoscaling), not both")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def enabled(self) -> bool:
        """Replicas on Ray Serve (else one in-process engine per model, no Ray)."""
        return self.replicas > 1 or self.autoscaling


class GemelConfig(BaseModel):
    """Top-level configuration (``gemel serve --config gemel.yaml``)."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: list[ModelEntry] = Field(
        default_factory=list, description="generative models served; default: engine.model with the stock aliases"
    )
    embeddings: EmbeddingModelEntry | None = Field(default_factory=EmbeddingModelEntry)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    observability: ObservabilityConfig = Field(default_factory=ObservabilityConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    routes: list[RouteConfig] = Field(
        default_factory=list, description="public names over weighted models: canaries, stickiness, a fallback"
    )
    scale: ScaleConfig = Field(default_factory=ScaleConfig, description="engine replicas on Ray Serve; default one, no Ray")

    @field_validator("cache", mode="before")
    @classmethod
    def _cache_off(cls, value):
        return {} if value is None else value  # `cache: null` is the default: no caches

    @model_validator(mode="after")
    def _response_cache_store(self) -> GemelConfig:
        rc = self.cache.response
        if rc is not None and rc.backend == "redis" and not (rc.redis_url or self.gateway.redis_url):
            raise ValueError("cache.response.backend redis needs cache.response.redis_url (or gateway.redis_url)")
        return self

    @model_validator(mode="after")
    def _default_catalogue(self) -> GemelConfig:
        if not self.models:
            self.models = [default_model_entry(self.engine.model)]
        names: set[str] = set()
        entries: list = list(self.models) + ([self.embeddings] if self.embeddings else [])
        for entry in entries:
            for name in [entry.id, *entry.aliases]:
                if name in names:
                    raise ValueError(f"model name {name!r} is used twice in the catalogue")
                names.add(name)
        return self

    @model_validator(mode="after")
    def _check_routes(self) -> GemelConfig:
        """Route names are new names; their targets and fallback are generative catalogue models."""
        ids = {m.id for m in self.models}
        taken = {name for m in self.models for name in [m.id, *m.aliases]}
        taken |= {self.embeddings.id, *self.embeddings.aliases} if self.embeddings else set()
        seen: set[str] = set()
        for route in self.routes:
            if route.name in taken:
                raise ValueError(f"route name {route.name!r} is already a model id or alias")
            if route.name in seen:
                raise ValueError(f"route name {route.name!r} is used twice")
            seen.add(route.name)
            for model in [t.model for t in route.targets] + ([route.fallback] if route.fallback else []):
                if model not in ids:
                    raise ValueError(f"route {route.name!r}: {model!r} is not the id of a generative model of the catalogue")
        return self

    def engine_config(self, entry: ModelEntry) -> EngineConfig:
        """The engine settings of one catalogue model: engine defaults plus the entry's overrides."""
        update: dict = {"model": entry.source}
        if entry.dtype is not None:
            update["dtype"] = entry.dtype
        if entry.max_context is not None:
            update["max_model_len"] = entry.max_context
        return self.engine.model_copy(update=update)


def default_model_entry(source: str) -> ModelEntry:
    return ModelEntry(id=source, source=source, aliases=list(DEFAULT_ALIASES))


def load_config(path: str | None) -> GemelConfig:
    if path is None:
        return GemelConfig()
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    config = GemelConfig.model_validate(data)
    tenants = config.gateway.tenants_file
    if tenants:  # relative to the config file, wherever gemel serve is started from
        import os

        tenants = os.path.expanduser(tenants)
        config.gateway.tenants_file = os.path.join(os.path.dirname(os.path.abspath(path)), tenants)
    for name in ("tls_cert_file", "tls_key_file"):  # relative to the config file too
        value = getattr(config.grpc, name)
        if value:
            import os

            setattr(config.grpc, name, os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(value)))
    return config
