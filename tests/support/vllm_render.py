"""Render and tokenize chat requests with vLLM's own code, for
``tests/engines/test_tokenizer_vllm.py``: run by the Python of a vLLM installation (the
vLLM CPU virtualenv of the real-engine suite), not by the project's.

    <vllm-venv>/bin/python tests/support/vllm_render.py CASES.json OUT.json

Each case is ``{"tokenizer": DIR, "template": PATH or null, "body": {...}}``; each
result ``{"text", "ids"}``, or ``{"error"}`` when vLLM refuses the request. The
path is the one vLLM's OpenAI server takes for a chat request: the request model
(``ChatCompletionRequest``), its tools dumped by pydantic, the messages parsed by
``parse_chat_messages`` in the template's detected content format, the template
kwargs of ``build_chat_params``, ``safe_apply_chat_template`` (transformers'
``apply_chat_template``), then the tokenizer with the request's
``add_special_tokens``. Only the model config is a stand-in: a text-only model
without prompt embeddings.
"""

import json
import sys
from types import SimpleNamespace

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.renderers import chat_utils, hf

MODEL_CONFIG = SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None, hf_config=SimpleNamespace(),
                               is_multimodal_model=False, allowed_local_media_path=None, revision=None,
                               code_revision=None, trust_remote_code=False, model="tiny", tokenizer="tiny")


def render(case: dict) -> dict:
    tok = AutoTokenizer.from_pretrained(case["tokenizer"])
    template = open(case["template"], encoding="utf-8").read() if case["template"] else tok.chat_template
    try:
        req = ChatCompletionRequest(model="tiny", **case["body"])
        tools = None if req.tools is None else [t.model_dump() for t in req.tools]
        fmt = hf._detect_content_format(template, default="string")
        conversation, _, _ = chat_utils.parse_chat_messages(req.messages, MODEL_CONFIG, fmt)
        params = req.build_chat_params(template, "auto").with_defaults({"tools": tools, "tokenize": False})
        text = hf.safe_apply_chat_template(MODEL_CONFIG, tok, conversation, **params.get_apply_chat_template_kwargs())
        return {"text": text, "ids": tok.encode(text, add_special_tokens=req.add_special_tokens)}
    except Exception as e:  # vLLM answers such a request with a 400
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    cases = json.load(open(sys.argv[1], encoding="utf-8"))
    json.dump([render(c) for c in cases], open(sys.argv[2], "w", encoding="utf-8"))


if __name__ == "__main__":
    main()
