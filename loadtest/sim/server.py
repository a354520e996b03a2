"""A simulated vLLM-like inference server (aiohttp) on top of the engine model.

One :class:`SimBackend` = one emulated engine (:class:`loadtest.sim.engine.Engine`
driven in real time by :class:`~loadtest.sim.engine.AsyncEngineRunner`) behind an
HTTP server on its own loopback port. It speaks only HTTP; the gateway never imports it.

Endpoints (shapes follow vLLM's OpenAI server)
----------------------------------------------
* ``POST /v1/chat/completions``, ``POST /v1/completions``: streamed (SSE) or not.
  Chat messages are rendered with a ChatML template (:func:`render_chat`) and
  tokenized with the backend's tokenizer (:mod:`loadtest.sim.tokenizer`); ``prompt`` may be a string, a list of
  token ids (checked as vLLM checks them: :func:`check_token_ids`), or a one-element list of either. ``usage`` carries
  ``prompt_tokens_details.cached_tokens`` (prefix-cache hits, as vLLM reports them);
  with ``stream_options.include_usage`` a final ``choices: []`` chunk carries it
  (``continuous_usage_stats`` puts running usage on every chunk). ``max_tokens`` /
  ``max_completion_tokens`` (default: the rest of ``max_model_len``, as vLLM),
  ``ignore_eos``, ``min_tokens``, ``seed``, and for chat ``add_generation_prompt`` and
  ``continue_final_message`` (continue the last message: :func:`read_prompt`), and
  ``return_token_ids`` (vLLM's: the prompt's ids on the first chunk, each chunk's
  generated ids as its choice's ``token_ids``). A chat
  stream starts with a role-only chunk (``delta: {"role": "assistant", "content": ""}``)
  as vLLM's does; every generated token is one chunk and one whitespace-separated word.
  The output is greedy, a function of the prompt's text
  (:meth:`loadtest.sim.engine.Engine.add_request`): a generation continued on another
  backend (the prompt followed by the text generated so far) goes on with the same words.
* The other APIs engines serve (:mod:`loadtest.sim.apis`, one adapter each, all on the
  path of :meth:`SimBackend.serve`): ``POST /v1/responses`` (OpenAI Responses, streamed
  or not), ``POST /v1/messages`` (Anthropic Messages, streamed or not, errors in
  Anthropic's shape) and ``POST /v1/messages/count_tokens``; ``POST /v1/embeddings``
  (prefill only, deterministic vectors); ``POST /v1/rerank``, ``POST /rerank`` and
  ``POST /v1/score`` (prefill only, deterministic scores).
* ``kv_transfer_params`` (disaggregated prefill/decode, vLLM's NixlConnector flow):
  ``{"do_remote_decode": true}`` on a ``prefill``/``mixed`` backend runs the prompt, one
  token, and returns top-level ``kv_transfer_params`` (``do_remote_prefill``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, ``tp_size``, ``remote_num_tokens``, ...); sending those to a
  ``decode``/``mixed`` backend charges the KV transfer time (bytes over the profile's
  link bandwidth) instead of recomputing the prompt.
* ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``
  (``{"tokens": [ids]}`` -> ``{"prompt": text}``), ``POST /reset_prefix_cache``.
* LoRA adapters (``lora`` in the spec, :class:`loadtest.sim.spec.LoraConfig`): listed in
  ``/v1/models`` with ``parent`` (the base model) and ``max_model_len: null`` as vLLM
  lists them; ``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and
  ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) with vLLM's answers; a request
  naming an adapter runs with it (see the engine's LoRA model); exported as vLLM's
  ``vllm:lora_requests_info`` gauge (labels ``running_lora_adapters``,
  ``waiting_lora_adapters``: comma-separated names; ``max_lora``; value: the time).
* KV-cache events (``kv_events`` in the spec): the engine's stores, evictions and
  prefix-cache resets go out on a ZMQ PUB socket in vLLM's wire format, with a
  replay socket (:mod:`loadtest.sim.kv_event_publisher`); ``GET /kv_event_sources`` and
  ``/admin/stats`` give the bound addresses. A crash restarts the publisher with
  sequence 0 and an empty cache, as an engine restart does.
* ``tokenizer`` in the spec: prompts are tokenized with that ``tokenizer.json``
  (:class:`loadtest.sim.tokenizer.HFTokenizer`) instead of the emulator's.
* ``GET /metrics``: Prometheus text with vLLM's names and types (one registry per
  backend), plus ``sim:*`` metrics of the emulator itself.
* Admin: ``GET /admin/faults`` (current faults), ``POST /admin/faults`` (replace them;
  body = :class:`FaultConfig` fields, ``{}`` clears), ``POST /admin/crash``
  (``{"down_s": T}``), ``GET /admin/stats`` (engine + emulator health as JSON, the
  requests admitted by path in ``paths``).

Every API's request goes through the engine model (queueing, prefix cache, prefill
cost, ``cached_tokens``), the same faults, and vLLM's 404 for a model not served.
Client disconnect aborts the request in the engine (its KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import random
import time
import uuid
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from loadtest.sim import apis, tokenizer
from loadtest.sim.apis import Api
from loadtest.sim.engine import AsyncEngineRunner, Engine, RequestOutput, RequestStream, _Stat
from loadtest.sim.prompt import BadRequest, check_token_ids, dumps, error_response, prompt_token_ids, read_prompt
from loadtest.sim.spec import FaultConfig, KVEventsConfig, LoraConfig, SimBackendConfig

if TYPE_CHECKING:
    from loadtest.sim.kv_event_publisher import KVEventPublisher

# --- metrics ----------------------------------------------------------------------------

# Buckets as in vLLM's V1 Prometheus logger (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class _Metrics:
    """The Prometheus registry of one backend (rebuilt when the backend restarts,
    as a real server's counters restart from zero)."""

    def __init__(self, backend: SimBackend):
        self.backend = backend
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        self.labels = {"model_name": backend.cfg.models[0], "engine": "0"}
        r = self.registry

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self.labels)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Histogram of time per output token in seconds (per request mean).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                               TOKEN_BUCKETS)
        self.req_gen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.",
                            TOKEN_BUCKETS)
        r.register(_EngineCollector(backend, self.labels))

    def pump(self) -> None:
        """Move the engine's latency samples into the histograms."""
        s = self.backend.engine.pop_samples()
        for x in s["ttft_s"]:
            self.ttft.observe(x)
        for x in s["itl_s"]:
            self.itl.observe(x)
        for x in s["e2e_s"]:
            self.e2e.observe(x)
        for x in s["queue_s"]:
            self.queue.observe(x)
        for x in s["prefill_s"]:
            self.prefill.observe(x)
        for x in s["decode_s"]:
            self.decode.observe(x)
        for dec, n in zip(s["decode_s"], s["generation_tokens"]):
            if n > 1:
                self.tpot.observe(dec / (n - 1))
        for x in s["prompt_tokens"]:
            self.req_prompt.observe(x)
        for x in s["generation_tokens"]:
            self.req_gen.observe(x)


class _EngineCollector:
    """Gauges and counters read from the engine at scrape time."""

    def __init__(self, backend: SimBackend, labels: dict[str, str]):
        self.backend = backend
        self.labels = labels

    def describe(self):
        return []

    def collect(self):
        b = self.backend
        e = b.engine
        ln, lv = list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=ln)
            g.add_metric(lv, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=ln)
            c.add_metric(lv, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    e.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_cache_usage)
        yield gauge("vllm:gpu_cache_usage_perc",
                    "GPU KV-cache usage. 1 means 100 percent usage (deprecated name of kv_cache_usage_perc).",
                    e.kv_cache_usage)
        p = e.profile
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching",
                                         "gpu_memory_utilization", "engine"])
        info.add_metric([str(p.block_size), str(p.num_gpu_blocks), "auto", "True", "0.9", "0"], 1.0)
        yield info
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      e.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      e.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      e.num_preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local or external).",
                      e.prompt_tokens_cached_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      e.generation_tokens_total)
        rs = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                 labels=ln + ["finished_reason"])
        for reason in ("stop", "length", "abort"):
            rs.add_metric(lv + [reason], e.request_success.get(reason, 0))
        yield rs
        # The emulator's own health and extras.
        lc = b.lora
        if lc is not None:
            run, wait = e.lora_in_use()
            li = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            li.add_metric([str(lc.max_lora), ",".join(sorted(wait)), ",".join(sorted(run))], time.time())
            yield li
            yield counter("sim:lora_loads", "LoRA adapter weights read into host memory.", e.lora_loads)
        yield counter("sim:kv_transfer_tokens", "Prompt tokens received over the KV-transfer link.",
                      e.kv_transfer_tokens_total)
        yield counter("sim:kv_evictions", "Cached KV blocks evicted (hash dropped on reuse).", e.kv.num_evictions)
        yield counter("sim:kv_evictions_idle_session",
                      "Cached KV blocks evicted while the session that last used them (prompt_cache_key) had no "
                      "request in the engine.", e.kv_evictions_idle_session)
        yield counter("sim:engine_busy_seconds", "Sum of engine step durations (wall seconds).", e.busy_s_total)
        st = b.runner.overrun.summary()
        yield gauge("sim:step_overrun_p99_seconds",
                    "p99 over the last 4096 steps of how late a step's outputs were delivered.", st["p99"])
        yield gauge("sim:step_overrun_max_seconds", "Largest step delivery delay since start.", st["max"])
        yield counter("sim:late_steps", "Steps delivered more than 1 ms late.", b.runner.late_steps)
        fi = CounterMetricFamily("sim:faults_injected", "Faults injected, by kind.", labels=ln + ["fault"])
        for k, v in sorted(b.faults_injected.items()):
            fi.add_metric(lv + [k], v)
        yield fi
        yield counter("sim:crashes", "Emulated crashes (the server stopped listening).", b.crashes)
        pub = b.kv_publisher
        if pub is not None:
            yield counter("sim:kv_event_batches_published", "KV-event batches sent on the PUB socket "
                          "since the last restart.", pub.published)
            yield counter("sim:kv_event_batches_dropped", "KV-event batches not sent (fault "
                          "kv_events_drop_rate) since the last restart.", pub.dropped)
        lag = LOOP_LAG.lag.summary()
        yield gauge("sim:event_loop_lag_p99_seconds",
                    "p99 over the last 4096 samples of the emulator process's event-loop lag.", lag["p99"])
        yield gauge("sim:event_loop_lag_max_seconds", "Largest event-loop lag of the emulator process.",
                    lag["max"])


# --- emulator health -------------------------------------------------------------------


class LoopLagMonitor:
    """Event-loop lag of this process: a task sleeps ``interval_s`` and records how
    much later than asked it woke up (seconds). One per process; every backend's
    ``/admin/stats`` and ``sim:event_loop_lag_*`` report it."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.lag = _Stat()
        self._task: asyncio.Task | None = None
        self._users = 0

    def acquire(self) -> None:
        self._users += 1
        if self._task is None or self._task.done():
            self.lag = _Stat()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def release(self) -> None:
        self._users -= 1
        if self._users <= 0 and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(self.interval_s)
            self.lag.add(max(0.0, loop.time() - t - self.interval_s))


LOOP_LAG = LoopLagMonitor()


# --- the backend ------------------------------------------------------------------------

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class SimBackend:
    """One simulated backend: engine, runner, metrics, faults and its HTTP server.

    ``await start()`` listens (``url`` is then set); ``await cleanup()`` stops it;
    ``await crash(down_s)`` emulates a crash and restart on the same port.
    """

    def __init__(self, cfg: SimBackendConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.profile = cfg.build_profile()
        self.role = cfg.role or self.profile.role
        self.faults = cast(FaultConfig, cfg.faults)  # the spec normalised its dict form
        self.faults_injected: dict[str, int] = {}
        self.crashes = 0
        self.http_requests = 0
        self.paths: dict[str, int] = {}  # requests admitted, by path (GET /admin/stats)
        self._ids = itertools.count()
        self._rng = random.Random(self.faults.seed)
        self.tok: tokenizer.Tokenizer = (tokenizer.HFTokenizer(cfg.tokenizer) if cfg.tokenizer
                                         else tokenizer.EMULATOR)
        self.kv_events = cast(KVEventsConfig | None, cfg.kv_events)  # likewise
        self.lora = cast(LoraConfig | None, cfg.lora)  # likewise
        self.kv_publisher: KVEventPublisher | None = None
        self._kv_addresses: tuple[str, str | None] | None = None
        self._new_engine()
        self.app_runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None
        self.host = cfg.host
        self.port = cfg.port
        self.url = ""
        self.up = asyncio.Event()  # set while listening
        self._tasks: set[asyncio.Task] = set()
        self._crash_task: asyncio.Task | None = None
        self._pump_task: asyncio.Task | None = None

    def _new_engine(self) -> None:
        self.engine = Engine(self.profile, speed=self.cfg.speed,
                             engine_id=f"{self.cfg.name}-{uuid.uuid4().hex[:8]}",
                             kv_events=self.kv_events is not None, tok=self.tok)
        self.runner = AsyncEngineRunner(self.engine, on_step=self._publish_kv_events)
        self.metrics = _Metrics(self)
        lc = self.lora
        # Registered adapters (what /v1/models lists) and their ids: the spec's, as a
        # restart reloads them. An id is vLLM's lora_int_id: 1, 2, ... in load order,
        # counted by the server (vllm/entrypoints/openai/models/serving.py).
        self._lora_ids = itertools.count(1)
        self.lora_adapters: dict[str, int] = {}
        for a in (lc.adapters if lc is not None else ()):
            self._register_lora(a)
        if lc is not None:
            self.engine.enable_lora(lc.max_lora, lc.max_cpu_loras if lc.max_cpu_loras is not None else lc.max_lora,
                                    lc.load_s, lc.swap_s)

    def _register_lora(self, name: str) -> int:
        """Adapter ``name``'s id, registering it with the next one if it is new."""
        lid = self.lora_adapters.get(name)
        if lid is None:
            lid = self.lora_adapters[name] = next(self._lora_ids)
        return lid

    def _start_kv_publisher(self) -> None:
        """A fresh publisher (sequence 0, empty replay buffer) on the first start's
        addresses; raises OSError naming the address when one cannot be bound."""
        if self.kv_events is None:
            return
        import zmq

        from loadtest.sim.kv_event_publisher import KVEventPublisher
        pub = KVEventPublisher(self.kv_events, block_size=self.profile.block_size, seed=self.faults.seed,
                               addresses=self._kv_addresses)
        try:
            pub.start()
        except zmq.ZMQError as e:
            raise OSError(e.errno, f"backend {self.cfg.name!r}: cannot bind the KV-event sockets "
                          f"({pub.endpoint}, {pub.replay_endpoint}): {e}") from None
        pub.set_faults(self.faults.kv_events_drop_rate, self.faults.kv_events_stop)
        self._kv_addresses = (pub.endpoint, pub.replay_endpoint)
        self.kv_publisher = pub

    async def _restart_kv_publisher(self, tries: int = 200) -> None:
        """:meth:`_start_kv_publisher` on the addresses the old publisher just closed,
        which libzmq's I/O thread releases a moment after the close: retried every
        10 ms while they are still in use (bounded: ``tries``)."""
        for _ in range(tries - 1):
            try:
                self._start_kv_publisher()
                return
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
            await asyncio.sleep(0.01)
        self._start_kv_publisher()

    async def _stop_kv_publisher(self) -> None:
        pub, self.kv_publisher = self.kv_publisher, None
        if pub is not None:
            await pub.close()

    def _publish_kv_events(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.publish(self.engine.take_kv_events())

    # --- lifecycle ---------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/chat/completions", self.completions)
        r.add_post("/v1/completions", self.completions)
        for path, api in apis.ROUTES:
            r.add_post(path, functools.partial(self.serve, api=api))
        r.add_post("/v1/messages/count_tokens", self.count_tokens)
        r.add_get("/v1/models", self.models)
        r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics_handler)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/admin/faults", self.get_faults)
        r.add_post("/admin/faults", self.set_faults)
        r.add_post("/admin/crash", self.crash_handler)
        r.add_get("/admin/stats", self.stats_handler)
        r.add_get("/kv_event_sources", self.kv_event_sources)
        return app

    async def start(self) -> str:
        """Listen on ``cfg.host:cfg.port`` and start the engine (and its KV-event
        publisher). Returns the base URL."""
        self._start_kv_publisher()
        self.runner.start()
        self.app_runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.app_runner.setup()
        self.site = web.TCPSite(self.app_runner, self.host, self.port, reuse_address=True)
        await self.site.start()
        self.port = self.app_runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        self.up.set()
        LOOP_LAG.acquire()
        self._lag_acquired = True
        self._pump_task = asyncio.get_running_loop().create_task(self._pump())
        self._schedule_crashes()
        return self.url

    async def cleanup(self) -> None:
        """Stop serving and the engine (idempotent)."""
        for t in (self._crash_task, self._pump_task, *self._tasks):
            if t is not None:
                t.cancel()
        self.up.clear()
        if getattr(self, "_lag_acquired", False):
            self._lag_acquired = False
            LOOP_LAG.release()
        if self.app_runner is not None:
            await self.app_runner.cleanup()
            self.app_runner = None
        await self.runner.stop()
        await self._stop_kv_publisher()

    async def crash(self, down_s: float, *, spare: asyncio.BaseTransport | None = None) -> None:
        """Emulate a crash: drop every connection (except ``spare``, which is closed
        after its response), stop listening and lose all engine state; listen again on
        the same port ``down_s`` seconds later with a cold engine."""
        if self.app_runner is None or self.site is None or not self.up.is_set():
            return
        self.crashes += 1
        self.up.clear()
        await self.site.stop()
        server = self.app_runner.server
        assert server is not None  # set up before the site started
        for proto in list(server.connections):
            tr = proto.transport
            if tr is None:
                continue
            if tr is spare:
                proto.force_close()
                continue
            tr.abort()
        await self.runner.stop()
        await self._stop_kv_publisher()
        self._revive = asyncio.Event()
        try:
            await asyncio.wait_for(self._revive.wait(), down_s)
        except TimeoutError:
            pass
        self._new_engine()
        await self._restart_kv_publisher()
        self.runner.start()
        self.site = web.TCPSite(self.app_runner, self.host, self.port, reuse_address=True)
        await self.site.start()
        self.up.set()

    def revive(self) -> None:
        """End a crash's downtime now (for tests and in-process drivers)."""
        ev = getattr(self, "_revive", None)
        if ev is not None:
            ev.set()

    def _schedule_crashes(self) -> None:
        if self._crash_task is not None:
            self._crash_task.cancel()
            self._crash_task = None
        f = self.faults
        after_s = f.crash_after_s
        if after_s is None:
            return

        async def loop() -> None:
            await asyncio.sleep(after_s)
            while True:
                await self.crash(f.crash_down_s)
                if f.crash_every_s is None:
                    return
                await asyncio.sleep(f.crash_every_s)

        self._crash_task = asyncio.get_running_loop().create_task(loop())

    async def _pump(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.metrics.pump()

    # --- simple handlers -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm", "root": m, "parent": None,
                 "max_model_len": self.profile.max_model_len} for m in self.cfg.models]
        data += [{"id": a, "object": "model", "created": 0, "owned_by": "vllm", "root": f"/adapters/{a}",
                  "parent": self.cfg.models[0], "max_model_len": None} for a in self.lora_adapters]
        return web.json_response({"object": "list", "data": data}, dumps=dumps)

    async def _lora_name(self, request: web.Request) -> str:
        """The ``lora_name`` of a LoRA admin body; raises :class:`BadRequest`."""
        if self.lora is None:
            raise BadRequest("LoRA is not enabled on this server", status=404)
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise BadRequest("invalid JSON body") from None
        name = data.get("lora_name") if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRequest("`lora_name` is required", "lora_name")
        return name

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/load_lora_adapter``: reads the weights (``load_s``), then
        the adapter is served and listed."""
        try:
            name = await self._lora_name(request)
            if name in self.lora_adapters or name in self.cfg.models:
                raise BadRequest(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        except BadRequest as e:
            return e.response()
        lc = self.lora
        assert lc is not None  # _lora_name answered 404 otherwise
        await asyncio.sleep(lc.load_s / self.cfg.speed)
        self._register_lora(name)
        self.engine.preload_lora(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /v1/unload_lora_adapter``."""
        try:
            name = await self._lora_name(request)
            if name not in self.lora_adapters:
                raise BadRequest(f"The lora adapter '{name}' cannot be found.", "lora_name", status=404)
        except BadRequest as e:
            return e.response()
        del self.lora_adapters[name]
        self.engine.unload_lora(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.pump()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read())
            if not isinstance(data, dict):
                raise BadRequest("the body must be a JSON object")
            ids = prompt_token_ids(data, "messages" in data, self.tok)
        except orjson.JSONDecodeError:
            return error_response(400, "invalid JSON body")
        except BadRequest as e:
            return e.response()
        return web.json_response({"count": len(ids), "max_model_len": self.profile.max_model_len,
                                  "tokens": ids}, dumps=dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: ``{"model"?, "tokens": [ids]}`` ->
        ``{"prompt": text}``; ids checked as a prompt's are, a model named must be served."""
        try:
            data = orjson.loads(await request.read())
            if not isinstance(data, dict):
                raise BadRequest("the body must be a JSON object")
            model = data.get("model")
            if model is not None and model not in self.cfg.models and model not in self.lora_adapters:
                raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
            toks = data.get("tokens")
            if not isinstance(toks, list):
                raise BadRequest("`tokens` must be a list of token ids", "tokens")
            ids = check_token_ids(toks, "body.tokens", self.tok.vocab_size) if toks else []
        except orjson.JSONDecodeError:
            return error_response(400, "invalid JSON body")
        except BadRequest as e:
            return e.response()
        return web.json_response({"prompt": self.tok.detokenize(ids)}, dumps=dumps)

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.engine.reset_prefix_cache()
        self._publish_kv_events()
        return web.Response(status=200)

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        """The publisher's config by data-parallel rank, shaped as vLLM 0.32's answer
        (``{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...,
        "replay_endpoint": ..., "buffer_steps": ..., "topic": ...}}``) with the bound
        addresses, plus what a gateway wiring these events needs that vLLM's answer
        leaves to its own config: ``block_size`` (tokens per KV block) and
        ``base_model`` (the model the blocks without a LoRA adapter are keyed under);
        ``{}`` when KV events are off."""
        pub = self.kv_publisher
        if pub is None:
            return web.json_response({}, dumps=dumps)
        c = pub.cfg
        return web.json_response({str(c.data_parallel_rank): {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint, "buffer_steps": c.buffer_steps, "topic": c.topic,
            "block_size": self.profile.block_size, "base_model": self.cfg.models[0]}},
            dumps=dumps)

    async def get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.to_dict(), dumps=dumps)

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read() or b"{}")
            if not isinstance(data, dict):
                raise ValueError("the body must be a JSON object of fault fields")
            self.faults = FaultConfig.from_dict(data)
        except (orjson.JSONDecodeError, ValueError, TypeError) as e:
            return error_response(400, str(e))
        self._rng = random.Random(self.faults.seed)
        if self.kv_publisher is not None:
            self.kv_publisher.set_faults(self.faults.kv_events_drop_rate, self.faults.kv_events_stop)
        self._schedule_crashes()
        return web.json_response(self.faults.to_dict(), dumps=dumps)

    async def crash_handler(self, request: web.Request) -> web.Response:
        try:
            data = orjson.loads(await request.read() or b"{}")
            down_s = float(data.get("down_s", self.faults.crash_down_s))
            if down_s < 0:
                raise ValueError
        except (orjson.JSONDecodeError, ValueError, TypeError, AttributeError):
            return error_response(400, "body must be {\"down_s\": seconds >= 0}")
        resp = web.json_response({"crashing": True, "down_s": down_s}, dumps=dumps)
        await resp.prepare(request)
        await resp.write_eof()
        t = asyncio.get_running_loop().create_task(self.crash(down_s, spare=request.transport))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return resp

    def stats(self) -> dict[str, Any]:
        return {"name": self.cfg.name, "profile": self.profile.name, "role": self.role,
                "speed": self.cfg.speed, "engine_id": self.engine.engine_id, "crashes": self.crashes,
                "http_requests": self.http_requests, "paths": dict(self.paths),
                "faults_injected": dict(self.faults_injected),
                "engine": self.engine.stats(), "runner": self.runner.stats(),
                "kv_events": None if self.kv_publisher is None else self.kv_publisher.stats(),
                "event_loop_lag_s": LOOP_LAG.lag.summary()}

    async def stats_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats(), dumps=dumps)

    # --- the request path every engine API shares ---------------------------------------

    def _inject(self, kind: str) -> None:
        self.faults_injected[kind] = self.faults_injected.get(kind, 0) + 1

    def _output_tokens(self, data: dict[str, Any], ids: list[int]) -> int | None:
        e = self.cfg.eos_after
        if e is None or data.get("ignore_eos"):
            return None
        if isinstance(e, int):
            n = e
        else:
            lo, hi = e
            # Deterministic across runs: derived from the token ids, not Python's hash().
            n = lo + (sum(ids[-64:]) * 2654435761 + len(ids)) % (hi - lo + 1)
        mt = data.get("min_tokens")
        if isinstance(mt, int) and mt > n:
            n = mt
        return n

    async def _admit(self, request: web.Request) -> tuple[dict[str, Any], dict[str, Any]]:
        """Count the request, read its JSON object body and its ``model`` (one this
        backend serves, or a LoRA adapter it has or can resolve), then apply the faults
        due before the first byte (stall, hang, error, rate limit). Returns the body and
        the LoRA keywords for :meth:`_submit` (``lora``, ``lora_id``). Raises
        :class:`BadRequest`: 400 for a body that is no JSON object, vLLM's 404 for a
        model not served, the injected error or 429 (with ``Retry-After``)."""
        self.http_requests += 1
        self.paths[request.path] = self.paths.get(request.path, 0) + 1
        try:
            data = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            raise BadRequest("invalid JSON body") from None
        if not isinstance(data, dict):
            raise BadRequest("the body must be a JSON object")
        model = data.get("model")
        lora: dict[str, Any] = {"lora": None, "lora_id": None}
        if model not in self.cfg.models:
            lc = self.lora
            if isinstance(model, str) and model and (model in self.lora_adapters or (lc is not None and lc.dynamic)):
                lora = {"lora": model, "lora_id": self._register_lora(model)}  # a resolver registers it
            else:
                raise BadRequest(f"The model `{model}` does not exist.", "model", status=404)
        f = self.faults
        rng = self._rng
        if f.stall_s > 0:
            self._inject("stall")
            await asyncio.sleep(f.stall_s)
        if f.hang_rate and rng.random() < f.hang_rate:
            self._inject("hang")
            await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
        if f.error_rate and rng.random() < f.error_rate:
            self._inject("error")
            raise BadRequest(f"simulated failure (HTTP {f.error_status})", status=f.error_status)
        if f.rate_limit_rate and rng.random() < f.rate_limit_rate:
            self._inject("rate_limit")
            ra = f.retry_after_s
            ra_text = str(int(ra)) if float(ra).is_integer() else f"{ra:g}"
            raise BadRequest("simulated rate limit", status=429, headers={"Retry-After": ra_text})
        return data, lora

    def _max_tokens(self, max_tokens: int | None, ids: list[int]) -> int:
        """``max_tokens`` as asked, else the spec's default, else the rest of
        ``max_model_len`` (as vLLM)."""
        if max_tokens is not None:
            return max_tokens
        return self.cfg.max_tokens_default or max(1, self.profile.max_model_len - len(ids))

    def _submit(self, rid: str, ids: list[int], max_tokens: int, data: dict[str, Any], **kw: Any) -> RequestStream:
        """Put one prompt (token ids) into the engine as part of request ``rid``; ``kw``
        as :meth:`Engine.add_request` takes it, to which the body's ``seed`` and, unless
        ``prefill_only``, the spec's ``eos_after`` are added. Close the stream (or read
        it to the end): closing it early aborts the request. The body's
        ``prompt_cache_key`` tags it with its session (``sim:kv_evictions_idle_session``).
        Raises :class:`BadRequest`
        when the engine refuses it (context length, KV blocks)."""
        if not kw.get("prefill_only"):
            kw.setdefault("output_tokens", self._output_tokens(data, ids))
        seed = data.get("seed")
        if isinstance(seed, int) and not isinstance(seed, bool):
            kw["seed"] = seed & 0xFFFFFFFFFFFFFFFF
        session = data.get("prompt_cache_key")
        if isinstance(session, str) and session:
            kw["session"] = session
        try:
            return self.runner.submit(f"{rid}-{next(self._ids)}", ids, max_tokens, **kw)
        except ValueError as e:
            raise BadRequest(str(e)) from None

    async def _collect(self, request: web.Request, rs: RequestStream) -> tuple[list[int], RequestOutput]:
        """Every token of a request not streamed and its last output, under the faults
        ``close_after_chunks`` (the connection drops after that many tokens) and
        ``drip_s`` (the answer waits that long per token)."""
        f = self.faults
        toks: list[int] = []
        last: RequestOutput | None = None
        async for out in rs:
            toks.extend(out.new_token_ids)
            last = out
            if f.close_after_chunks is not None and len(toks) >= f.close_after_chunks:
                self._inject("close")
                self._close_connection(request)
        assert last is not None
        if f.drip_s > 0:
            self._inject("drip")
            await asyncio.sleep(f.drip_s * max(1, len(toks)))
        return toks, last

    async def _cut(self, request: web.Request, stall: bool) -> NoReturn:
        """Cut a stream (``close_after_chunks``: the connection drops), or with ``stall``
        (``stall_after_chunks``) send nothing more until the client goes away."""
        if stall:
            self._inject("stall_mid_stream")
            await asyncio.Event().wait()
        self._inject("close")
        self._close_connection(request)

    def _close_connection(self, request: web.Request) -> NoReturn:
        tr = request.transport
        if tr is not None:
            tr.abort()
        raise asyncio.CancelledError  # nothing more to send on this connection

    async def _relay(self, request: web.Request, rs: RequestStream, head: list[bytes],
                     render: Callable[[RequestOutput], list[bytes]],
                     tail: Callable[[], list[bytes]]) -> web.StreamResponse:
        """Stream a request as SSE: headers at once (as vLLM's StreamingResponse), the
        ``head`` events, ``render(output)``'s events for each engine output (outputs
        that piled up are written together), then ``tail()``'s. Faults: ``drip_s``
        before each event, ``close_after_chunks`` drops the connection after that many
        events and ``stall_after_chunks`` sends nothing more after that many
        events (head and token events count, the tail does not)."""
        f = self.faults
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        sent = 0
        close_after = f.close_after_chunks if f.close_after_chunks is not None else f.stall_after_chunks
        stall = f.close_after_chunks is None and f.stall_after_chunks is not None
        drip = f.drip_s
        if drip > 0:
            self._inject("drip")

        async def send(parts: list[bytes]) -> None:
            nonlocal sent
            if drip > 0:
                for part in parts:
                    if close_after is not None and sent >= close_after:
                        await self._cut(request, stall)
                    await asyncio.sleep(drip)
                    await resp.write(part)
                    sent += 1
                return
            if close_after is not None and sent + len(parts) >= close_after:
                keep = close_after - sent
                if keep > 0:
                    await resp.write(b"".join(parts[:keep]))
                await self._cut(request, stall)
            if parts:
                await resp.write(b"".join(parts))
                sent += len(parts)

        if head:
            await send(head)
        async for out in rs:
            outs = [out]
            if drip <= 0:
                outs.extend(rs.ready())  # coalesce tokens that piled up into one write
            await send([part for o in outs for part in render(o)])
        if close_after is not None and sent >= close_after:
            await self._cut(request, stall)
        await resp.write(b"".join(tail()))
        await resp.write_eof()
        return resp

    async def serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        """The handler of every API in :mod:`loadtest.sim.apis`: :meth:`_admit`, the
        API reads the request (:meth:`Api.parse`), each of its prompts goes into the
        engine (prefill only, one engine request per input, for a pooling API), and the
        API shapes the answer, whole (:meth:`Api.whole`) or streamed
        (:meth:`Api.events`). Refusals are answered in the API's error shape."""
        with contextlib.ExitStack() as held:
            try:
                data, lora = await self._admit(request)
                job = api.parse(data, self.tok)
                rid = api.id_prefix + uuid.uuid4().hex
                streams: list[RequestStream] = []
                for ids in job.prompts:
                    if api.pooling:
                        rs = self._submit(rid, ids, 1, data, prefill_only=True, **lora)
                    else:
                        if job.text is not None:  # the output follows from the prompt's text (Engine.add_request)
                            lora = {**lora, "context": zlib.crc32(job.text.encode())}
                        rs = self._submit(rid, ids, self._max_tokens(job.max_tokens, ids), data, **lora)
                    streams.append(held.enter_context(rs))
            except BadRequest as e:
                return api.error(e)
            created = int(time.time())
            if job.stream and not api.pooling:
                ev = api.events(job, rid, created, self.tok)
                return await self._relay(request, streams[0], ev.head(), ev.tokens, ev.tail)
            results = [await self._collect(request, rs) for rs in streams]
            body = api.whole(job, rid, created, results, self.tok)
            return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, the
        prompt as a Messages request renders it (nothing runs in the engine)."""
        api = apis.MESSAGES
        try:
            data, _ = await self._admit(request)
            return web.json_response(api.count_tokens(data, self.tok), dumps=dumps)
        except BadRequest as e:
            return api.error(e)

    # --- completions ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            data, lora = await self._admit(request)
            model = data["model"]
            ids, text = read_prompt(data, chat, self.tok)
            max_tokens = data.get("max_completion_tokens")
            if max_tokens is None:
                max_tokens = data.get("max_tokens")
            max_tokens = self._max_tokens(max_tokens, ids)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise BadRequest("max_tokens must be an integer >= 1", "max_tokens")
            if data.get("n", 1) not in (1, None):
                raise BadRequest("the simulator supports n=1 only", "n")
            stream = data.get("stream", False)
            if not isinstance(stream, bool):
                raise BadRequest("`stream` must be a boolean", "stream")
            so = data.get("stream_options") or {}
            if not isinstance(so, dict):
                raise BadRequest("`stream_options` must be an object", "stream_options")
            kvp = data.get("kv_transfer_params")
            if kvp is not None and not isinstance(kvp, dict):
                raise BadRequest("`kv_transfer_params` must be an object", "kv_transfer_params")
        except BadRequest as e:
            return e.response()

        kw: dict[str, Any] = dict(lora)
        if text is not None:  # the output follows from the prompt's text (Engine.add_request)
            kw["context"] = zlib.crc32(text.encode())
        prefill_only = bool(kvp and kvp.get("do_remote_decode") and self.role in ("mixed", "prefill"))
        if prefill_only:
            kw["prefill_only"] = True
            max_tokens = 1
        elif kvp and kvp.get("do_remote_prefill") and self.role in ("mixed", "decode"):
            n = kvp.get("remote_num_tokens") or kvp.get("num_tokens")
            if not isinstance(n, int):
                n = len(kvp.get("remote_block_ids") or []) * self.profile.block_size
            kw["remote_prefill_tokens"] = max(0, int(n))

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            rs = self._submit(rid, ids, max_tokens, data, **kw)
        except BadRequest as e:
            return e.response()
        with rs:
            ctx = _Ctx(rid, int(time.time()), model, chat, len(ids))
            if stream:
                return await self._stream(request, rs, ctx, so, ids if data.get("return_token_ids") is True else None)
            return await self._complete(request, rs, ctx)

    async def _complete(self, request: web.Request, rs: RequestStream, ctx: _Ctx) -> web.StreamResponse:
        toks, last = await self._collect(request, rs)
        text = self.tok.detokenize(toks)
        kvp = None
        if last.kv_transfer_params is not None:
            kvp = dict(last.kv_transfer_params, remote_host=self.host, remote_port=self.port)
        usage = ctx.usage(len(toks), last.num_cached_tokens)
        if ctx.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": last.finish_reason, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason,
                      "stop_reason": None, "prompt_logprobs": None}
            obj = "text_completion"
        body = {"id": ctx.rid, "object": obj, "created": ctx.created, "model": ctx.model, "choices": [choice],
                "usage": usage, "prompt_logprobs": None, "kv_transfer_params": kvp}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _stream(self, request: web.Request, rs: RequestStream, ctx: _Ctx, so: dict,
                      prompt_ids: list[int] | None) -> web.StreamResponse:
        """A streamed chat or completions answer; ``prompt_ids``: the prompt's ids when
        the request asked ``return_token_ids`` (vLLM's: the prompt's ids on the first
        chunk, top-level for chat, in the choice for completions; each chunk's generated
        ids as its choice's ``token_ids``), else ``None``."""
        include_usage = bool(so.get("include_usage"))
        continuous = include_usage and bool(so.get("continuous_usage_stats"))
        head = ctx.chunk_head()
        n_gen = 0
        cached = 0
        first = True

        def render(o: RequestOutput) -> list[bytes]:
            nonlocal n_gen, cached, first
            parts = []
            cached = o.num_cached_tokens
            ids: dict[str, Any] | None = None
            if first and ctx.chat:
                first = False
                role = {**head, "prompt_token_ids": prompt_ids} if prompt_ids is not None else head
                parts.append(ctx.chunk(role, {"role": "assistant", "content": ""}, None,
                                       ctx.usage(0, cached) if continuous else None))
            if prompt_ids is not None:
                ids = {"token_ids": list(o.new_token_ids)}
                if first:
                    first = False
                    ids["prompt_token_ids"] = prompt_ids
            n_gen += len(o.new_token_ids)
            parts.append(ctx.chunk(head, self.tok.detokenize(o.new_token_ids), o.finish_reason,
                                   ctx.usage(n_gen, cached) if continuous else None, ids))
            return parts

        def tail() -> list[bytes]:
            parts = []
            if include_usage:
                parts.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": ctx.usage(n_gen, cached)})
                             + b"\n\n")
            return [*parts, b"data: [DONE]\n\n"]

        return await self._relay(request, rs, [], render, tail)



class _Ctx:
    """Per-request constants for building response bodies."""

    __slots__ = ("rid", "created", "model", "chat", "prompt_tokens")

    def __init__(self, rid: str, created: int, model: str, chat: bool, prompt_tokens: int):
        self.rid, self.created, self.model, self.chat, self.prompt_tokens = rid, created, model, chat, prompt_tokens

    def usage(self, completion: int, cached: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens + completion,
                "completion_tokens": completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk_head(self) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model}

    def chunk(self, head: dict, content: Any, finish: str | None, usage: dict | None,
              ids: dict[str, Any] | None = None) -> bytes:
        if self.chat:
            delta = content if isinstance(content, dict) else {"content": content}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}
        if finish is not None and self.chat:
            choice["stop_reason"] = None
        if ids is not None:
            choice.update(ids)
        obj = {**head, "choices": [choice]}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"


async def start_backends(configs: list[SimBackendConfig]) -> tuple[list[SimBackend], dict[str, str]]:
    """Start each backend on its own port. Returns the backends (``await
    b.cleanup()`` each to stop) and ``{name: base_url}``."""
    backends: list[SimBackend] = []
    urls: dict[str, str] = {}
    try:
        for cfg in configs:
            b = SimBackend(cfg)
            backends.append(b)
            urls[cfg.name] = await b.start()
    except BaseException:
        for b in backends:
            await b.cleanup()
        raise
    return backends, urls
