"""The adapter interface: what one API that the gateway serves differs in.

The pipeline (front door, estimate, route, attempt, retry, fallback, relay, settle,
usage ledger, limits, admission, the endpoint picker, batch) knows nothing of any API;
each API is an :class:`Api` whose few methods say how its requests and answers read:

- :meth:`Api.read`: the fields routing needs from a request object (model, stream,
  output-token cap), validated (400 in the API's terms);
- :meth:`Api.view`: the request's prompt as the engine will render it, as a chat
  request (``{"messages": [...], "tools": [...]}``, rendered through the model's chat
  template) or a text one (``{"prompt": ...}``), per :attr:`Api.prompt_kind`; the
  decision core estimates that view, and tokenizes it with the model's own tokenizer
  when the view is the prompt the engine tokenizes (:attr:`Api.exact_view`), so
  routing is the same for every API;
- :meth:`Api.usage_in` and :meth:`Api.counts`: where an answer (whole, or one event of
  a stream) reports its usage, and the (prompt, cached prompt, completion) tokens it
  reports;
- :meth:`Api.token_count_answer` and :meth:`Api.tokenizer_answer`: the answer of an API
  that the gateway computes from the prompt's tokens (count_tokens, input_tokens,
  tokenize, detokenize) without an engine;
- :meth:`Api.error_body` and :meth:`Api.error_event`: an error in the shape that API's
  clients parse, whole or as the last event of a stream;
- :meth:`Api.continuable`, :meth:`Api.relayed_text`, :meth:`Api.continuation` and
  :meth:`Api.spliced`: how a stream whose backend failed is continued on another
  (:mod:`gateway.pipeline.migration`): whether a request may be, the text one event
  relayed, the request that continues after that text, and a continuation's event
  rewritten into the client's stream (an API that defines none is never continued);
  :attr:`Api.token_leg` and :meth:`Api.token_continuation`: with the model's tokenizer,
  the same as a completions request whose prompt is token ids (the prompt's, then the
  answer's so far), whose stream :attr:`Api.token_leg` rewrites into the client's;

and a few attributes: its path, its OpenTelemetry ``gen_ai.operation.name``, whether it
generates (embeddings and rerank do not: their cost is prefill only), how its stream
ends and which of its events carries one output token. The registry
(:mod:`gateway.apis.registry`) maps paths and names to adapters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from gateway.errors import ClientError

if TYPE_CHECKING:
    from routing.core import ModelTokenizer


class Fields(NamedTuple):
    """What routing reads from a request: the model, whether the answer streams,
    whether the client asked a stream for its usage (``stream_options.include_usage``;
    APIs whose streams always carry it: ``True``), and the output-token cap (``None``:
    unset; 0: an API that generates nothing)."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None


def missing(field: str, data: dict[str, Any], what: str) -> ClientError:
    """The 400 for a required ``field`` of ``data`` that is absent or not ``what``."""
    return ClientError(400, f"`{field}` is required and must be {what}.", param=field,
                       code="invalid_value" if field in data else "missing_required_parameter")


def check_chat_messages(data: dict[str, Any]) -> None:
    """``data["messages"]``: a non-empty array of objects with a string ``role``.
    Raises :class:`ClientError` 400 naming the first one that is not."""
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise missing("messages", data, "a non-empty array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ClientError(400, f"`messages[{i}]` must be an object with a string `role`.",
                              param=f"messages[{i}]", code="invalid_value")


def read_model(data: dict[str, Any]) -> str:
    """``data["model"]``. Raises :class:`ClientError` 400 unless a non-empty string."""
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise missing("model", data, "a non-empty string")
    return model


def read_stream(data: dict[str, Any]) -> bool:
    """``data["stream"]`` (absent or null: ``False``). Raises :class:`ClientError` 400
    unless a boolean."""
    stream = data.get("stream", False)
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise ClientError(400, "`stream` must be a boolean.", param="stream", code="invalid_type")
    return stream


def optional_int(data: dict[str, Any], field: str, minimum: int) -> int | None:
    """``data[field]`` when set (absent or null: ``None``). Raises :class:`ClientError`
    400 unless an integer of at least ``minimum``."""
    v = data.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ClientError(400, f"`{field}` must be an integer >= {minimum}.", param=field, code="invalid_value")
    return v


class Api:
    """One API's adapter (see the module docstring). Subclasses set the attributes and
    override what differs; the defaults are OpenAI's (error shape, ``usage`` object)."""

    name = ""  # its short name: metric label, log field, ``ParsedRequest.endpoint``
    path = ""  # the path clients send it to, and the path it goes to on a backend
    aliases: tuple[str, ...] = ()  # other client paths served as ``path`` (sent upstream as ``path``)
    operation = ""  # OpenTelemetry GenAI ``gen_ai.operation.name``
    prompt_kind = "chat"  # how :meth:`view` renders: "chat" (chat template) or "completions" (text)
    prompt_param = "messages"  # the request field a context-length error names
    exact_view = True  # :meth:`view` is the prompt the engine tokenizes (False: an approximation, never counted exact)
    generates = True  # False: no output tokens (embeddings, rerank): cost is prefill only
    disaggregates = False  # may be split into a prefill leg and a decode leg
    stateful = False  # its conversations are kept by the gateway (gateway.pipeline.conversation)
    counts_tokens = False  # its answer is computed from the prompt's tokens (:meth:`tokenizer_answer`)
    variants = False  # its requests come in more than one form, each its own adapter (:meth:`variant`)
    end_events: frozenset[bytes] = frozenset()  # SSE event names that end its stream; empty: ``data: [DONE]``
    delta_event = b""  # the SSE event name of one output token; empty: every ``data:`` event
    session_field: str | None = None  # the request field naming a session (gateway.pipeline.session)
    user_field: str | None = None  # the request field naming the end user, dotted into objects
    token_leg: Api | None = None  # the adapter of its token continuation's stream (:meth:`token_continuation`)
    continues_text = True  # :meth:`continuation` may continue it without a tokenizer (False: by token ids only)
    relays_done = True  # a continuation's ``data: [DONE]`` goes to the client (False: a client API without it)
    streams_token_ids = False  # its stream carries the ids generated when asked ``return_token_ids`` (vLLM's)

    def read(self, data: dict[str, Any]) -> Fields:
        """The routing fields of request ``data``. Raises :class:`ClientError` 400."""
        raise NotImplementedError

    def view(self, data: dict[str, Any]) -> dict[str, Any]:
        """Request ``data``'s prompt as a chat or completions request (see
        :attr:`prompt_kind`): the request itself for those two APIs."""
        return data

    def usage_in(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The usage object in ``obj``, a whole answer or one stream event, or ``None``."""
        usage = obj.get("usage")
        return usage if isinstance(usage, dict) else None

    def counts(self, usage: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
        """The (prompt, cached prompt, completion) tokens ``usage`` reports, each
        ``None`` when it does not (OpenAI's ``prompt_tokens``,
        ``prompt_tokens_details.cached_tokens``, ``completion_tokens``)."""
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return (pt if isinstance(pt, int) else None, max(cached, 0) if isinstance(cached, int) else None,
                ct if isinstance(ct, int) else None)

    def expand(self, data: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
        """A stateful API: request ``data`` with the stored turn ``record`` (of
        :meth:`record`) it continues put before its own input."""
        raise NotImplementedError

    def record(self, data: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
        """A stateful API: what is kept of a turn, request ``data`` (expanded) and its
        ``answer`` object, for the next turn's :meth:`expand`."""
        raise NotImplementedError

    def variant(self, data: dict[str, Any]) -> Api:
        """The adapter of request ``data``'s form, for an API with :attr:`variants`
        (``/tokenize``: a prompt, or chat messages rendered by the chat template)."""
        return self

    def token_count_answer(self, prompt_tokens: int) -> bytes | None:
        """The whole answer to a request whose prompt counts ``prompt_tokens`` (by the
        model's own tokenizer, or the gateway's estimate when no backend serves the
        API), when that count is all the API answers (the gateway then answers without
        an engine); ``None``: an engine answers."""
        return None

    def tokenizer_answer(self, token_ids: Sequence[int], tokenizer: ModelTokenizer, data: dict[str, Any],
                         max_model_len: int | None) -> bytes | None:
        """The whole answer to request ``data`` whose prompt the model's ``tokenizer``
        made ``token_ids`` (``max_model_len``: the model's context, ``None`` unknown),
        when the gateway answers it without an engine (:attr:`counts_tokens`); ``None``:
        an engine answers. By default the count's answer (:meth:`token_count_answer`).
        Raises :class:`ClientError` 400."""
        return self.token_count_answer(len(token_ids))

    def error_body(self, status: int, body: bytes) -> bytes:
        """``body``, an OpenAI error body answered with ``status``, in this API's shape."""
        return body

    def error_event(self, status: int, body: bytes) -> bytes:
        """The SSE event that ends a broken stream of this API with ``body``, an OpenAI
        error body for ``status`` (OpenAI's: a ``data:`` event holding it, as vLLM and
        OpenAI send it; the openai SDK raises it)."""
        return b"data: " + body + b"\n\n"


    def continuable(self, data: dict[str, Any]) -> bool:
        """Whether a stream answering request ``data`` may be continued on another
        backend when its own fails: only when the continuation can be faithful (the
        same answer a greedy engine would have given, the request's parameters kept)."""
        return False

    def relayed_text(self, event: dict[str, Any]) -> str | None:
        """The text one event of a stream of this API adds to the answer (``""``: none),
        or ``None`` when what it carries cannot be continued as text (a tool call,
        reasoning, logprobs, another choice, the answer's end, an error)."""
        return None

    def follow(self, event: dict[str, Any], head: dict[str, Any]) -> None:
        """Note in ``head`` what a continuation's rewrite (:meth:`spliced`) needs of
        ``event``, one event of the stream being continued, read at the failure: by
        default the identity fields (``id``, ``created``, ``model``) of its first event."""
        if not head:
            head.update({k: event[k] for k in ("id", "created", "model") if k in event})

    def continuation(self, data: dict[str, Any], text: str, tokens: int) -> dict[str, Any] | None:
        """The request object that continues the answer to request ``data`` after its
        first ``tokens`` tokens, ``text``, went to the client: the same request, the
        text as the start of the answer, the output-token caps reduced by ``tokens``;
        ``None`` when it cannot be continued (no token left)."""
        return None

    def token_continuation(self, data: dict[str, Any], token_ids: list[int], tokens: int,
                           room: int | None) -> dict[str, Any] | None:
        """The completions request (``POST /v1/completions``, streamed) that continues
        the answer to request ``data`` after its first ``tokens`` tokens went to the
        client: ``token_ids`` the prompt's ids then the answer's so far, as the engine
        tokenized them; the output-token caps reduced by ``tokens`` (unset: ``room``,
        what the model's context leaves, ``None`` unknown); the request's sampling
        parameters carried over. Its stream is read and rewritten by :attr:`token_leg`.
        ``None``: not continued by token ids (the text continuation may still be made)."""
        return None

    def spliced(self, event: dict[str, Any], head: dict[str, Any], prompt_tokens: int | None,
                tokens: int, echo: str = "") -> dict[str, Any] | list[dict[str, Any]] | None:
        """A continuation's stream ``event`` rewritten as an event of the client's
        stream, whose first event's identity fields were ``head`` and which had relayed
        ``tokens`` tokens before; its usage says ``prompt_tokens`` (``None``: the
        continuation's prompt less ``tokens``) and the whole answer's completion tokens.
        ``echo``: until the continuation's first text, the text relayed before it, which
        an engine may send again at the start of its answer (llama.cpp's Messages does:
        it answers a last assistant message with that message's text first), to be
        left out when the event's text begins with it.
        ``None``: the event is dropped (a second start of the answer); a list: the
        events, typed (their ``type``), that replace it."""
        return event


def reshape(api: Api, status: int, body: bytes) -> bytes:
    """An error ``body`` for ``api``'s clients: OpenAI's, reshaped by the adapter."""
    return body if type(api).error_body is Api.error_body else api.error_body(status, body)


def error_message(body: bytes) -> tuple[str, str | None]:
    """The message and code of an OpenAI error body (``("", None)`` when it is not one)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "", None
    err = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return "", None
    message, code = err.get("message"), err.get("code")
    return (message if isinstance(message, str) else "", code if isinstance(code, str) else None)
