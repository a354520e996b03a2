"""State kept outside the process: ``state`` (Redis), ``batch`` and the usage ledger
(``usage``, with its prices)."""

from __future__ import annotations

from pydantic import (
    Field,
    field_validator,
)

from gateway.config.base import Strict


class StateStore(Strict):
    """Where the routing state lives: in this process (default) or shared by every
    replica through Redis (see :mod:`gateway.store.routing_state`). Changing it needs a restart."""

    url: str | None = Field(
        None, description="`redis://[:password@]host:port/db`, `rediss://` (TLS), `unix://` or "
        "`redis+sentinel://[:password@]h1:26379,h2:26379/service[/db]` (Sentinel): share load, prefix "
        "placement and per-key limits with the other replicas. Unset: this process only.")
    namespace: str = Field(
        "turbo-gateway", pattern=r"^[A-Za-z0-9_.:-]+$",
        description="Keys are `tg:{namespace}:...` (the braces are a Redis Cluster hash tag).")
    staleness_s: float = Field(
        0.05, gt=0, le=60, description="Bound on the age of the other replicas' view; the background sync "
        "runs every half of it.")
    lease_s: float = Field(
        2.0, gt=0, description="A replica's load stops counting this long after its last sync (a killed "
        "replica leaks nothing).")
    timeout_s: float = Field(0.25, gt=0, description="Connect and read timeout of every Redis call.")
    prefix_stream_maxlen: int = Field(
        20000, ge=100, description="Recent dispatches (prefix blocks) kept in Redis for replicas that "
        "start late.")
    cluster: bool = Field(False, description="Connect with redis-py's `RedisCluster` (Redis Cluster).")

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        if v is not None and v.startswith("redis+sentinel://"):
            from gateway.store.redis_client import parse_sentinel_url
            parse_sentinel_url(v)
        return v


class Batch(Strict):
    """The Batch API and its queue consumers (:mod:`gateway.batch`)."""

    enabled: bool = Field(
        False, description="Serve `/v1/files` and `/v1/batches` and run the batch life cycle (needs Redis: "
        "`batch.redis_url` or `state.url`).")
    files_dir: str = Field(
        "batch-files", description="Where uploaded, output and error files live (shared by every replica "
        "that serves the Batch API).")
    redis_url: str | None = Field(
        None, description="Redis holding the line queue and the batch records (`redis://`, `rediss://`, "
        "`unix://` or `redis+sentinel://`); unset: `state.url`.")
    gateway_url: str | None = Field(
        None, description="Where `python -m gateway.batch` consumers send lines; unset: the `listen` "
        "address.")
    workers: int = Field(
        16, ge=0, le=4096, description="Lines this gateway process drains itself, concurrently (0: none; "
        "batches then run only while `python -m gateway.batch` consumers drain the queue).")
    ttft_slo_s: float = Field(
        2.0, gt=0, description="Batch lines are admitted only while the fleet's estimated TTFT for an "
        "interactive request (`interactive_prompt_tokens` long) stays within this.")
    interactive_prompt_tokens: int = Field(
        512, ge=1, description="Prompt length of the interactive request whose estimated TTFT `ttft_slo_s` "
        "bounds.")
    max_share: float = Field(
        0.5, gt=0, le=1, description="Batch lines hold at most this share of the fleet's KV-cache capacity "
        "(estimated prompt and output tokens of the lines in flight).")
    admission_wait_s: float = Field(
        2.0, gt=0, description="A line waits this long for admission, then gets 429 `batch_deferred` (the "
        "consumer retries it; not counted as an attempt).")
    request_timeout_s: float = Field(180.0, gt=0, description="Timeout of one attempt of one line.")
    max_attempts: int = Field(3, ge=1, le=20, description="Attempts of one line in all; the final failure "
                              "goes to the error file with the backend's status and error body.")
    base_backoff_s: float = Field(0.5, ge=0, description="Base of a line's full-jitter backoff between "
                                  "attempts (as `retries.base_backoff_s`).")
    max_backoff_s: float = Field(30.0, ge=0, description="Cap of a line's backoff between attempts.")
    visibility_timeout_s: float = Field(
        60.0, gt=0, description="A line claimed by a consumer that stopped heartbeating (killed) is "
        "reclaimed by another consumer after this long.")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="A consumer that stops (`python -m gateway.batch` on SIGTERM/SIGINT, "
        "`workers` at gateway shutdown, after the HTTP drain) takes no new line and gives the lines in "
        "flight this long to finish, then hands the rest back for other consumers to take at once. Keep it "
        "below the supervisor's kill timeout (Kubernetes 30 s, `docker stop` 10 s).")
    max_file_bytes: int = Field(200 * 1024 * 1024, gt=0, description="Largest file upload accepted.")
    max_files_per_key: int | None = Field(
        1000, ge=1, description="Files one key may hold at once (its uploads and its batches' output and error "
        "files); an upload past it gets 429 `quota_exceeded`. Unset: unlimited.")
    max_bytes_per_key: int | None = Field(
        10 * 1024 ** 3, ge=1, description="Bytes of files one key may hold at once (as `max_files_per_key`); "
        "an upload that would pass it gets 429 `quota_exceeded`. Unset: unlimited.")
    max_active_batches_per_key: int | None = Field(
        100, ge=1, description="Batches of one key not yet in a final state; another gets 429 "
        "`quota_exceeded`. Unset: unlimited.")
    batch_file_expires_s: int | None = Field(
        30 * 86400, ge=3600, description="An uploaded file of purpose `batch` without `expires_after` is deleted "
        "this long after its upload (OpenAI's default: 30 days). Files of other purposes are kept until deleted "
        "unless their upload gives `expires_after`. Unset: kept.")
    output_file_expires_s: int | None = Field(
        30 * 86400, ge=3600, description="A batch's output and error files are deleted this long after they "
        "were written, unless the batch gave `output_expires_after` (OpenAI's default: 30 days). Unset: kept.")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
            raise ValueError("must be a redis://, rediss://, unix:// or redis+sentinel:// URL")
        return v


class Price(Strict):
    """What one model's tokens cost, per million tokens (any currency; the ledger's
    ``cost`` is in the same one)."""

    input: float = Field(ge=0, description="Per million prompt tokens not served from the prefix cache.")
    cached_input: float | None = Field(
        None, ge=0, description="Per million prompt tokens the backend served from its prefix cache "
        "(`usage.prompt_tokens_details.cached_tokens`); unset: `input`.")
    output: float = Field(ge=0, description="Per million completion tokens.")


class Usage(Strict):
    """The usage ledger (:mod:`gateway.tenancy.usage_ledger`): requests, tokens, errors and cost per
    client key and model, in hourly buckets. With ``state.url`` every replica adds its
    counts to the same Redis buckets (flushed in the background, never on the request
    path); without it they stay in this process."""

    retention_days: int = Field(
        90, ge=1, le=3650, description="Hourly buckets are kept this long after their hour ended (Redis "
        "`EXPIREAT`; in-process buckets are pruned alike).")
    flush_interval_s: float = Field(
        1.0, gt=0, le=3600, description="How often this replica adds its counts to the shared buckets "
        "(`state.url`); a failed flush is retried with the same counts next time.")
    max_query_hours: int = Field(
        744, ge=1, le=87600, description="Most hours one `GET /v1/usage` or `/admin/usage` reads (one Redis "
        "hash per hour): a `since` further back than `until` minus this starts at that hour instead, and the "
        "answer's `since` says so (31 days by default; ask for earlier windows one at a time).")
    max_buffered_buckets: int = Field(
        100_000, ge=1, description="Bound on the (key, model, hour) entries waiting for a flush while "
        "Redis is unreachable; a request that would need a new entry past it is not recorded and counts in "
        "`turbo_gateway_usage_dropped_requests_total`.")
    prices: dict[str, Price] = Field(
        {}, description="Prices per model (the `model` a backend serves), per million tokens: `input`, "
        "`cached_input`, `output`. A request is charged at the prices in force when it settled; a model "
        "without a price costs 0.")


class StoredResponses(Strict):
    """The Responses API's stored responses (``store``, the API's default) and
    conversations, kept by the gateway for the whole fleet rather than by the engine that
    made each one (:mod:`gateway.store.responses`): in Redis at ``state.url`` when it is
    set (every replica sees them, and they outlive any backend), else in this process."""

    ttl_s: int = Field(
        30 * 24 * 3600, gt=0, description="How long a stored response (its output and input items) is kept "
        "for `previous_response_id` and `GET /v1/responses/{id}`, and a conversation after its last change; "
        "OpenAI keeps responses 30 days.")
    max_record_bytes: int = Field(
        8 * 1024 * 1024, gt=0, description="A response whose record (input items and output) is larger is "
        "not stored (a later turn naming it gets a 400); a conversation item larger is refused (400).")
    max_in_process: int = Field(
        10000, gt=0, description="Without `state.url`: the most recent responses and conversations kept in "
        "this process.")
