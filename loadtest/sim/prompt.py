"""Reading a request for the simulated engine: the prompt it asks for and the refusals.

* :func:`render_chat`: the ChatML rendering of chat messages every chat-like API of the
  simulator uses (chat completions, Responses, Anthropic Messages), so a conversation
  shares its prefix-cache blocks across turns whatever API carries it.
* :func:`prompt_token_ids`: a chat or completions request's prompt as token ids, checked
  as vLLM checks them; :func:`read_prompt` with its text, from which the output follows.
* :class:`BadRequest`: a refusal (status, message, param, error type, headers), which
  each API answers in its own error shape; :func:`error_response` is the OpenAI/vLLM one.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from loadtest.sim import tokenizer


def content_text(content: Any) -> str:
    """The text of a message's ``content``: a string, or a list of parts whose texts
    are joined by newlines (an image part is ``<image>``, an audio part ``<audio>``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") in ("image_url", "input_image", "image"):
                    parts.append("<image>")
                elif p.get("type") == "input_audio":
                    parts.append("<audio>")
            elif isinstance(p, str):
                parts.append(p)
        return "\n".join(parts)  # as vLLM joins a message's text parts
    return "" if content is None else str(content)


def render_chat(messages: list[Any], tools: Any = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """ChatML rendering of chat messages, ending with the assistant header::

        <|im_start|>system\\nYou are...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

    ``add_generation_prompt=False``: without the header. ``continue_final_message``: the
    last message is left open (no ``<|im_end|>``), so the model continues it (vLLM's
    and SGLang's request fields of the same names): a partial answer sent back this way
    renders as the header followed by that text, exactly what the model had generated."""
    out = []
    if tools:
        out.append("<|im_start|>system\n# Tools\n" + orjson.dumps(tools).decode() + "<|im_end|>\n")
    for m in messages:
        if not isinstance(m, dict):
            continue
        text = content_text(m.get("content"))
        if m.get("tool_calls"):
            text += orjson.dumps(m["tool_calls"]).decode()
        out.append(f"<|im_start|>{m.get('role', 'user')}\n{text}<|im_end|>\n")
    if continue_final_message and out:
        out[-1] = out[-1][: -len("<|im_end|>\n")]
    elif add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


class BadRequest(Exception):
    """A request the server refuses: ``status`` (400 by default), the ``param`` it
    names, ``etype``, the error ``type`` when it is not the status's usual one, and
    ``headers`` for the answer (``Retry-After``). Each API answers it in its own error
    shape; :meth:`response` is the OpenAI one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, etype: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.param = param
        self.status = status
        self.etype = etype
        self.headers = headers

    def response(self) -> web.Response:
        return error_response(self.status, str(self), param=self.param, etype=self.etype, headers=self.headers)


# vLLM answers a request body that fails its pydantic model with this error type
# (`validation_exception_handler` in vllm/entrypoints/serve/exception_handling/).
VALIDATION_ERROR_TYPE = "Bad Request"


def check_token_ids(p: list[Any], loc: str, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked as vLLM 0.32 checks it: its request model
    (``prompt: list[Annotated[int, Field(ge=0)]] | ...``, pydantic's lax integers, so
    ``true`` is 1 and ``2.0`` is 2) and then its renderer's vocabulary check
    (``validate_token_ids`` in ``vllm/renderers/base.py``). Raises :class:`BadRequest`
    with vLLM's wording: an element that is no integer or a negative one names its
    place (``param`` ``body.prompt.I``, type ``Bad Request``); an id past the
    vocabulary (``vocab_size`` ids) is ``Token id N is out of vocabulary``."""
    out = []
    for i, x in enumerate(p):
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        elif isinstance(x, float):
            raise BadRequest("Input should be a valid integer, got a number with a fractional part",
                             f"{loc}.{i}", etype=VALIDATION_ERROR_TYPE)
        elif not isinstance(x, int):  # bool is an int
            raise BadRequest("Input should be a valid integer", f"{loc}.{i}", etype=VALIDATION_ERROR_TYPE)
        if x < 0:
            raise BadRequest("Input should be greater than or equal to 0", f"{loc}.{i}",
                             etype=VALIDATION_ERROR_TYPE)
        out.append(int(x))
    top = max(out)
    if top >= vocab_size:
        raise BadRequest(f"Token id {top} is out of vocabulary")
    return out


def prompt_token_ids(data: dict[str, Any], chat: bool,
                     tok: tokenizer.Tokenizer = tokenizer.EMULATOR) -> list[int]:
    """Token ids of the request's prompt with ``tok`` (a rendered chat without added
    special tokens, a text prompt with them, as vLLM). A prompt given as token ids is
    checked as vLLM checks it (:func:`check_token_ids`). Raises :class:`BadRequest`."""
    return read_prompt(data, chat, tok)[0]


def read_prompt(data: dict[str, Any], chat: bool,
                tok: tokenizer.Tokenizer = tokenizer.EMULATOR) -> tuple[list[int], str | None]:
    """The request's prompt: its token ids (:func:`prompt_token_ids`) and its text (a
    chat rendered, a text prompt, token ids decoded with their special tokens), from
    which the engine's output follows (:meth:`loadtest.sim.engine.Engine.add_request`'s
    ``context``): a chat's rendered ids followed by the ids it generated, sent as a
    completions prompt, go on with the same words, as on a real engine.

    A chat may ask to continue its last message (``continue_final_message: true`` with
    ``add_generation_prompt: false``; both true is vLLM's 400): the text is rendered
    open-ended (:func:`render_chat`) and the last message's text is tokenized apart from
    the template before it, as a BPE tokenizer keeps the header's newline apart from the
    next word, so that a partial answer sent back counts the tokens it was generated as.
    Raises :class:`BadRequest`."""
    if chat:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("`messages` must be a non-empty list", "messages")
        agp, cont = data.get("add_generation_prompt", True), data.get("continue_final_message", False)
        if not isinstance(agp, bool) or not isinstance(cont, bool):
            raise BadRequest("`add_generation_prompt` and `continue_final_message` must be booleans",
                             "continue_final_message")
        if agp and cont:
            raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        tools = data.get("tools")
        last = msgs[-1]
        if cont and isinstance(last, dict):
            head = render_chat([*msgs[:-1], {"role": last.get("role", "user"), "content": ""}], tools, False, True)
            tail = content_text(last.get("content"))
            ids = tok.tokenize(head, add_special_tokens=False) + (tok.tokenize(tail, add_special_tokens=False)
                                                                  if tail else [])
            return ids, head + tail
        text = render_chat(msgs, tools, agp)
        return tok.tokenize(text, add_special_tokens=False), text
    p = data.get("prompt")
    loc = "body.prompt"
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p, loc = p[0], "body.prompt.0"
    if isinstance(p, str):
        return tok.tokenize(p), p
    if isinstance(p, list) and len(p) > 1 and (all(isinstance(x, str) for x in p)
                                               or all(isinstance(x, list) for x in p)):
        raise BadRequest("the simulator serves one prompt per request (batched prompts are not supported)",
                         "prompt")
    if isinstance(p, list) and p and isinstance(p[0], (int, float)):
        ids = check_token_ids(p, loc, tok.vocab_size)
        return ids, tok.prompt_text(ids)
    raise BadRequest("`prompt` must be a string or a list of token ids", "prompt")


def dumps(o: Any) -> str:
    """JSON text of ``o`` (orjson), for ``web.json_response(dumps=...)``."""
    return orjson.dumps(o).decode()


def error_response(status: int, message: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None, etype: str | None = None) -> web.Response:
    """An OpenAI-shaped error (``{"error": {message, type, param, code}}``); ``etype``:
    the ``type``, by default the one vLLM gives ``status``."""
    etype = etype or {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError"}.get(
        status, "InternalServerError" if status >= 500 else "BadRequestError")
    body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
    return web.json_response(body, status=status, headers=headers, dumps=dumps)
