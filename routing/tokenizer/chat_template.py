"""Chat template rendering: a chat request's prompt text, rendered as vLLM renders it.

The messages are parsed as vLLM's ``entrypoints/chat_utils.py`` parses them (text parts
joined by ``"\\n"`` for templates that take string content, kept as ``{"type": "text",
"text"}`` parts for templates that loop over ``message['content']``; assistant
``tool_calls`` with their ``arguments`` parsed from JSON (``_postprocess_messages``), an
empty list dropped; ``tool_call_id``, ``name``, ``reasoning``), then rendered with the
chat template in the Jinja environment of transformers' ``apply_chat_template``
(``utils/chat_template_utils.py``: ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True, extensions=[loopcontrols])``, a ``tojson`` filter that does not
escape HTML, ``raise_exception`` and ``strftime_now`` globals, the special tokens map as
variables), with the request's ``add_generation_prompt`` (default true),
``continue_final_message``, ``documents``, ``tools`` and ``chat_template_kwargs``.

What cannot be reproduced exactly raises :class:`~routing.tokenizer.errors.Unsupported`:
non-text content parts, a per-request ``chat_template``, a template that raises.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from routing.tokenizer.errors import Unsupported

# vLLM's text content parts and the field holding each one's text (chat_utils.MM_PARSER_MAP)
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
               "refusal": "refusal"}
_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request line, dropped by vLLM
# chat_template_kwargs may not replace what the renderer itself passes
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "chat_template", "tokenize"})


# ---- the Jinja environment of transformers' apply_chat_template ----------------------

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # noqa: DTZ005 - local time, as transformers' strftime_now


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` tag (it marks the
    assistant's tokens for training masks); rendering keeps its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2.ext.Extension declares it so

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled as transformers compiles a chat template. Raises
    ``jinja2.TemplateSyntaxError``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def loops_over_content(source: str) -> bool:
    """Whether the template iterates over a message's ``content`` (``{% for part in
    message['content'] %}``): vLLM then passes content as a list of parts ("openai"
    content format) instead of a string (``chat_utils._detect_content_format``)."""
    try:
        ast = jinja2.Environment(extensions=[_Generation, jinja2.ext.loopcontrols]).parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
                and node.arg.value == "content":
            return True
    return False


# ---- vLLM's chat parsing --------------------------------------------------------------

class ChatTemplateRenderer:
    """Rendering with a model's chat template: the base of
    :class:`~routing.tokenizer.model_tokenizer.ModelTokenizer`, which holds the template
    as a Hugging Face tokenizer does (``tokenizer.apply_chat_template``).

    ``template``: the compiled template (``None``: the model has none);
    ``openai_content``: it loops over a message's content parts
    (:func:`loops_over_content`); ``developer_to_system``: it never names the developer
    role; ``special_tokens``: the variables of transformers' special tokens map.
    """

    template: jinja2.Template | None
    openai_content: bool
    developer_to_system: bool
    special_tokens: dict[str, Any]

    def render_chat(self, data: dict[str, Any]) -> str:
        """The chat request ``data``'s prompt text, rendered with the model's chat
        template as vLLM renders it. Raises :class:`Unsupported`."""
        if self.template is None:
            raise Unsupported("the model has no chat template")
        if data.get("chat_template") is not None:
            raise Unsupported("a per-request chat_template")
        messages = data.get("messages")
        if not isinstance(messages, list):
            raise Unsupported("no messages")
        conversation = [self._message(m) for m in messages]
        if self.developer_to_system and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        user = data.get("chat_template_kwargs")
        if user is None:
            user = {}
        if not isinstance(user, dict) or _RESERVED_KWARGS & user.keys():
            raise Unsupported("chat_template_kwargs")
        # the request's own fields win over chat_template_kwargs unless null or "auto"
        # (vLLM's ChatCompletionRequest.build_chat_params and merge_kwargs)
        effort = data.get("reasoning_effort")
        fields = {"add_generation_prompt": data.get("add_generation_prompt", True),
                  "continue_final_message": data.get("continue_final_message", False),
                  "documents": data.get("documents"), "reasoning_effort": effort}
        if effort is not None and "enable_thinking" not in user:
            fields["enable_thinking"] = effort != "none"
        kwargs = {**user, **{k: v for k, v in fields.items() if v is not None and v != "auto"}}
        if kwargs.get("add_generation_prompt") is None:
            kwargs["add_generation_prompt"] = True
        if kwargs.get("continue_final_message") and kwargs["add_generation_prompt"]:
            raise Unsupported("add_generation_prompt with continue_final_message")  # vLLM answers 400
        documents = kwargs.pop("documents", None)
        return self._render(conversation, _tools(data.get("tools")), documents, **kwargs)

    def _message(self, m: Any) -> dict[str, Any]:
        """One message as vLLM's ``_parse_chat_message_content`` makes it."""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Unsupported("a message without a role")
        role = m["role"]
        content = m.get("content")
        if content is None:
            content = []
        elif isinstance(content, str):
            content = [content]
        elif not isinstance(content, list):
            raise Unsupported("content that is neither a string nor a list of parts")
        parts: list[str] = []
        for p in content:
            if isinstance(p, dict) and p.get("type") in _TEXT_PARTS:
                p = p.get(_TEXT_PARTS[p["type"]])
                if p is None:
                    continue
            if not isinstance(p, str):
                raise Unsupported("a non-text content part")
            if role == "system" and p.startswith(_BILLING_HEADER):
                p = p.partition("\n")[2]
                if not p:
                    continue
            parts.append(p)
        out: dict[str, Any] = {"role": role}
        if self.openai_content and role != "tool":
            out["content"] = [{"type": "text", "text": t} for t in parts]
        else:  # joined as strings, where vLLM drops the empty ones
            out["content"] = "\n".join(t for t in parts if t)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls:  # an empty list is dropped, so the template takes its plain assistant path
                if not isinstance(calls, list):
                    raise Unsupported("tool_calls that are not a list")
                out["tool_calls"] = [_tool_call(c) for c in calls]
            if m.get("reasoning") is not None:
                out["reasoning"] = out["reasoning_content"] = m["reasoning"]
        elif role == "tool" and "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
        if role == "developer":
            out["tools"] = m.get("tools")
        return out

    def _render(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                documents: Any, *, continue_final_message: bool = False, **kwargs: Any) -> str:
        """transformers' ``render_jinja_template`` for one conversation."""
        assert self.template is not None
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = ""
        if continue_final_message:
            content = conversation[-1].get("content") if conversation else None
            if isinstance(content, str):
                final = content
                conversation[-1] = {**conversation[-1], "content": final + tag}
            elif isinstance(content, list) and any("text" in p for p in content):
                at = max(i for i, p in enumerate(content) if "text" in p)  # the last text part
                final = content[at]["text"]
                content = [*content[:at], {**content[at], "text": final + tag}, *content[at + 1:]]
                conversation[-1] = {**conversation[-1], "content": content}
            else:
                raise Unsupported("continue_final_message without a final text message")
        try:
            text = self.template.render(messages=conversation, tools=tools, documents=documents,
                                        **{**self.special_tokens, **kwargs})
        except Exception as e:  # noqa: BLE001 - any failure of the template
            # raise_exception(), a sandbox refusal, a template bug: the engine refuses it too
            raise Unsupported(f"the chat template raised {type(e).__name__}: {e}") from None
        if continue_final_message:
            if final.strip() not in text or tag.strip() not in text:
                raise Unsupported("continue_final_message: the template dropped the final message")
            at = text.rindex(tag.strip())
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages become system messages (without their ``tools``), and the
    system messages are merged into one first message (``"\\n\\n"`` between their
    texts) when there is more than one or one that is not first, as vLLM's
    ``_convert_developer_to_system`` and ``_consolidate_system_messages`` do."""
    out = []
    for m in conversation:
        if m["role"] == "developer":
            m = {k: v for k, v in m.items() if k != "tools"}
            m["role"] = "system"
        out.append(m)
    texts: list[str] = []
    rest = []
    merge = False
    for i, m in enumerate(out):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(texts)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            texts.append(content)
    if not merge:
        return out
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]


def _tool_call(c: Any) -> dict[str, Any]:
    """An assistant tool call as vLLM passes it to the template: the fields of the
    OpenAI type in its declaration order (``id``, ``function`` with ``arguments`` and
    ``name``, ``type``; others dropped, as pydantic validates the request), then
    ``arguments`` parsed from their JSON string (``{}`` when empty) by
    ``_postprocess_messages``, as transformers' templates expect."""
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
        raise Unsupported("a tool call that is not a function call")
    fn = c["function"]
    args = fn.get("arguments")
    if not args:
        args = {}
    elif not isinstance(args, (dict, list)):
        try:
            args = json.loads(args)
        except (TypeError, ValueError):
            raise Unsupported("tool call arguments that are not JSON") from None
    out: dict[str, Any] = {"id": c["id"]} if "id" in c else {}
    out["function"] = {"arguments": args, **({"name": fn["name"]} if "name" in fn else {})}
    if "type" in c:
        out["type"] = c["type"]
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """``tools`` as vLLM dumps its pydantic models for the template
    (``ChatCompletionToolsParam``, ``FunctionDefinition``): ``type``, then
    ``function`` with ``name``, ``description`` and ``parameters`` (``None`` when
    absent), ``strict`` and ``defer_loading`` only when set; other fields dropped."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Unsupported("tools that are not a list")
    out = []
    for t in tools:
        if (not isinstance(t, dict) or t.get("type", "function") != "function"
                or not isinstance(t.get("function"), dict)):
            raise Unsupported("a tool that is not a function")
        fn = t["function"]
        if not isinstance(fn.get("name"), str):
            raise Unsupported("a function without a name")
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        defer = fn.get("defer_loading")
        if defer is None:
            defer = t.get("defer_loading")
        if fn.get("strict") is not None:
            f["strict"] = fn["strict"]
        if defer is not None:
            f["defer_loading"] = defer
        tool: dict[str, Any] = {"type": "function", "function": f}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out
