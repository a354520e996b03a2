"""How a backend is chosen: ``routing`` (policy, canaries, fallbacks) and ``models``
(tokenizers, LoRA adapters)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.config.base import Strict
from routing.core import (
    DEFAULT_TOKENIZER_CACHE_TOKENS,
    POLICIES,
)


class CanarySplit(Strict):
    """Serve ``model`` from ``stable_pool`` and, for a ``canary_weight`` fraction of its
    requests (0 to 1, e.g. 0.05), from ``canary_pool``; a canary request that fails
    before its first byte is retried on the stable pool."""

    model: str = Field(description="The model whose requests are split.")
    stable_pool: str = Field(
        description="Pool serving the model's other requests, and canary requests that failed before "
        "their first byte.")
    canary_pool: str = Field(description="Pool receiving the canary share.")
    canary_weight: float = Field(
        0.05, ge=0, le=1, description="Fraction of the model's requests sent to `canary_pool` (0 to 1). "
        "Compare the pools with `turbo_gateway_pool_requests_total{pool,status}` and "
        "`turbo_gateway_pool_ttft_seconds{pool}`.")


FallbackTrigger = Literal["unavailable", "timeout", "first_token_timeout", "context_length"]


class Fallback(Strict):
    """One fallback of a model: the model to try next, and the failures that send a
    request there (only before its first byte reached the client)."""

    model: str = Field(description="The model to try next; a backend must serve it.")
    on: list[FallbackTrigger] = Field(
        ["unavailable", "timeout", "first_token_timeout"], min_length=1,
        description="The failures that trigger it: `unavailable` (no backend could take the request, or every "
        "attempt failed to connect, was cut or answered 429/5xx), `timeout` (connect or total timeout), "
        "`first_token_timeout` (no first byte within `timeouts.ttft_s`), `context_length` (the prompt is longer "
        "than the model's context: a backend answered `context_length_exceeded`).")


class Routing(Strict):
    """How a backend is chosen: the policy, the prefix index, pools, canaries and
    model fallbacks."""

    policy: str = Field(
        "estimated_ttft", description="The routing policy, one of: " + ", ".join(f"`{p}`" for p in sorted(POLICIES))
        + ". `estimated_ttft` sends each request where its first token is estimated to come soonest; the "
        "others are baselines (see docs/architecture.md, \"The routing model\").")
    block_tokens: int = Field(
        64, ge=1, le=65536, description="Prefix-index block size in tokens (a block is cut every "
        "`4 * block_tokens` bytes of canonical prompt text). Changing it needs a restart.")
    prefix_ttl_s: float = Field(
        600.0, gt=0, description="An indexed prefix block unused this long counts as evicted, unless its "
        "backend's engine was seen holding idle prefixes longer (learned from the cached tokens it reports "
        "for sessions' turns, up to `sessions.ttl_s`; docs/sessions.md). Changing it needs a restart.")
    prefix_index_max_blocks: int = Field(
        2_000_000, ge=1000, description="Memory bound of the prefix index (about 100 bytes a block). "
        "Changing it needs a restart.")
    speculative_s: float = Field(
        5.0, ge=0, le=600, description="For backends with `kv_events`: a prefix block recorded when a request is "
        "dispatched counts as held (`evidence=speculative`) for this long unless the engine's event confirms it "
        "(then `precise`); 0: only engine-confirmed blocks count.")
    long_prompt_tokens: int = Field(
        8192, ge=1, description="A request with more uncached prompt tokens than this goes to a `prefill` "
        "pool when one exists (with a `decode` pool too, it runs the disaggregated two-step flow).")
    scrape_interval_s: float = Field(
        2.0, ge=0, description="How often backends' `/metrics` are read to learn KV capacity and correct "
        "the load estimate's drift (0: never); samples older than 3 intervals are ignored.")
    canaries: list[CanarySplit] = Field(
        [], description="Canary (gray) releases: per model, a fraction of requests goes to a canary pool; a "
        "canary failure before the first byte is retried on the stable pool "
        "(`turbo_gateway_canary_fallbacks_total` counts them).")
    fallbacks: dict[str, list[Fallback]] = Field(
        {}, description="Model fallbacks: per model, an ordered list of other models to try when it cannot "
        "serve a request (after its own retries, within the same `retries.budget_s`, and only before the "
        "first byte reached the client); each fallback names the failures that trigger it. The request goes "
        "to the first fallback of the requested model's list, not yet tried, whose triggers include the "
        "failure (a fallback's own list is not followed). The answer is the "
        "fallback model's own (its `model` field is not rewritten); `x-turbo-route` says `fallback=MODEL`; "
        "`turbo_gateway_fallbacks_total{model,fallback,reason}` counts them.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        if v not in POLICIES:
            raise ValueError(f"unknown policy {v!r}; choose one of: {', '.join(sorted(POLICIES))}")
        return v


class LoraAdapter(Strict):
    """A LoRA adapter the gateway may load on a backend on demand (vLLM's
    ``POST /v1/load_lora_adapter``, which needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
    on the engine)."""

    base: str = Field(min_length=1, description="The base model the adapter applies to (a `model` name a backend "
                      "serves).")
    path: str = Field(min_length=1, description="The adapter's `lora_path` as the engine sees it (a local "
                      "directory on the engine's host, or what its LoRA resolver accepts).")


class ModelSettings(Strict):
    """What the gateway knows of one model beyond its name: its own tokenizer, so
    that prompts become the exact token ids the engine computes (token-exact prefix
    blocks, exact prompt token counts). Without one the model is served as before,
    on estimated tokens and byte-level prefix blocks.

    Relative paths are relative to the config file's directory. The files are read
    and checked when the config loads (and on reload); a bad file is a config error."""

    tokenizer: str | None = Field(
        None, description="The model's Hugging Face tokenizer: a `tokenizer.json` file, or a directory holding "
        "`tokenizer.json` and `tokenizer_config.json` (chat template, special tokens, `add_bos_token`), as a model "
        "repository has them (`special_tokens_map.json` and `chat_template.jinja` are read too when present). Chat "
        "requests are rendered with the chat template as vLLM renders them; with a lone `tokenizer.json` only "
        "completions (and chat with `chat_template`) are tokenized. Unset: no tokenizer.")
    chat_template: str | None = Field(
        None, description="A Jinja chat template file that replaces the model's own (as vLLM's `--chat-template`); "
        "needs `tokenizer`.")
    prefix_cache_tokens: int = Field(
        DEFAULT_TOKENIZER_CACHE_TOKENS, ge=0, description="Token ids of rendered prompt segments (cut at the "
        "tokenizer's special tokens, such as each message's start, and long messages about every 2,048 characters "
        "where the tokenizer allows it) kept so that a conversation's next turn, or a message that grew, tokenizes "
        "only its new text; 4 bytes each. 0: tokenize every prompt whole.")
    lora: LoraAdapter | None = Field(
        None, description="This model is a LoRA adapter that the backends with `lora.dynamic: true` serving its "
        "base model may load on demand: routing counts them as able to serve it (with the load in the estimated "
        "TTFT), and the gateway loads it on the one chosen before sending the request.")

    @field_validator("tokenizer", "chat_template")
    @classmethod
    def _resolve(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        p = Path(v).expanduser()
        base = (info.context or {}).get("config_dir")
        if not p.is_absolute() and base is not None:
            p = Path(base) / p
        return str(p)

    @model_validator(mode="after")
    def _template_needs_tokenizer(self) -> ModelSettings:
        if self.chat_template is not None and self.tokenizer is None:
            raise ValueError("`chat_template` needs `tokenizer`")
        return self
