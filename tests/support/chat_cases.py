"""Chat and completion requests whose prompts the parity tests compare with a real
engine's (``tests/engines/test_tokenizer_engine.py``: llama.cpp; ``tests/engines/test_tokenizer_vllm.py``:
vLLM's own renderer): several turns, system prompts, unicode, whitespace, text parts,
tools and tool calls, and the message fields vLLM treats specially."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "tiny-tokenizer"  # the tiny model's tokenizer.json and tokenizer_config.json (ChatML)
TOOLS_TEMPLATE = DATA / "templates" / "chatml_tools.jinja"
PARTS_TEMPLATE = DATA / "templates" / "chatml_parts.jinja"

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in one short paragraph."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [SYSTEM, {"role": "user", "content": "What is the capital of Switzerland?"}],
    [SYSTEM, {"role": "user", "content": "Grüß Gott — ça va? 世界 🙂 naïve café"},
     {"role": "assistant", "content": "Très bien, merci! 😊"},
     {"role": "user", "content": "Und jetzt: 日本語で答えて。"}],
    [SYSTEM, {"role": "user", "content": "def f(x):\n    return x * 2\n\n\tprint(f(3))  "},
     {"role": "assistant", "content": "  It prints 6.\n\n"},
     {"role": "user", "content": [{"type": "text", "text": "And f(4)?"}, {"type": "text", "text": "Explain."}]},
     {"role": "assistant", "content": "8"},
     {"role": "user", "content": "   spaces   and\n\n\nnewlines\r\n"}],
    [{"role": "user", "content": "The words " + " ".join(f"w{i}" for i in range(400))}],
]
COMPLETIONS = ["Once upon a time", " leading space", "Zürich 世界 🙂\n\n  code:\tx = 1",
               "text with <|im_start|>special<|im_end|> tokens", "", "a" * 3000]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather <city> & more",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "now", "description": "", "parameters": {}}}]
# (every field given: for an absent description or parameters, vLLM passes null to the
# template, as its pydantic models dump them, and llama.cpp "" and {})
TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "Weather in Zürich?"}],
    [SYSTEM, {"role": "user", "content": "Weather in Zürich?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "12 °C, föhn"},
     {"role": "user", "content": "Thanks! And the time?"}],
]
# what vLLM parses specially: Claude Code's billing header, a developer message, text
# part types and an empty one, reasoning and an empty tool_calls list, a name
EDGE_MESSAGES = [
    {"role": "system", "content": "x-anthropic-billing-header: cch=123\nReal system."},
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""},
                                 {"type": "input_text", "text": "b"}, "c", {"type": "refusal", "refusal": "no"}]},
    {"role": "assistant", "content": None, "reasoning": "hmm", "tool_calls": []},
    {"role": "assistant", "content": "ok", "name": "bot"},
    {"role": "user", "content": "go"},
]


def chat_bodies() -> list[dict]:
    """Chat request bodies for the parity tests."""
    bodies: list[dict] = [{"messages": c} for c in CONVERSATIONS]
    bodies += [{"messages": c, "tools": TOOLS} for c in TOOL_CONVERSATIONS]
    bodies.append({"messages": TOOL_CONVERSATIONS[1], "tools": [
        {"type": "function", "function": {"name": "f", "strict": True, "extra": 1}, "defer_loading": True}]})
    bodies += [{"messages": EDGE_MESSAGES}, {"messages": EDGE_MESSAGES, "reasoning_effort": "low"},
               {"messages": EDGE_MESSAGES,
                "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": False}},
               {"messages": [EDGE_MESSAGES[2], {"role": "assistant", "content": "par"}],
                "add_generation_prompt": False, "continue_final_message": True}]
    return bodies
