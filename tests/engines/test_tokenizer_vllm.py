"""Chat prompts as vLLM itself renders and tokenizes them.

``tests/support/vllm_render.py`` runs in the vLLM CPU virtualenv of the real-vLLM suite
(:func:`tests.support.engines.vllm_python`, built once by ``scripts/ci_build_vllm_cpu.sh``) and
takes each chat request through vLLM's own request model, message parsing, template kwargs and
``apply_chat_template``; the gateway's ``routing/tokenizer/`` must give the same text
and the same token ids, or refuse what vLLM refuses. Without that virtualenv the
module skips.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from routing.tokenizer import Unsupported, load_tokenizer
from tests.support import engines
from tests.support.chat_cases import PARTS_TEMPLATE, TINY, TOOLS_TEMPLATE, chat_bodies

pytestmark = [pytest.mark.engine, pytest.mark.slow]

VLLM_PYTHON = engines.vllm_python()
if VLLM_PYTHON is None:
    pytest.skip(engines.VLLM_ENABLE_HINT, allow_module_level=True)

TEMPLATES = [None, TOOLS_TEMPLATE, PARTS_TEMPLATE]
CASES = [{"tokenizer": str(TINY), "template": str(t) if t else None, "body": b}
         for b in chat_bodies() for t in TEMPLATES]


@pytest.fixture(scope="module")
def vllm_results(tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("vllm-render")
    (d / "cases.json").write_text(json.dumps(CASES))
    subprocess.run([str(VLLM_PYTHON), str(engines.ROOT / "tests" / "support" / "vllm_render.py"), str(d / "cases.json"),
                    str(d / "out.json")], check=True, capture_output=True, timeout=600)
    return json.loads((d / "out.json").read_text())


@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{(c['template'] or 'model').rsplit('/', 1)[-1]}-{n // len(TEMPLATES)}"
                              for n, c in enumerate(CASES)])
def test_chat_text_and_ids_match_vllms_own(vllm_results, i):
    case, theirs = CASES[i], vllm_results[i]
    tok = load_tokenizer(TINY, case["template"])
    if "error" in theirs:
        with pytest.raises(Unsupported):
            tok.tokenization("chat", case["body"])
        return
    assert tok.render_chat(case["body"]) == theirs["text"]
    assert list(tok.tokenization("chat", case["body"]).token_ids()) == theirs["ids"]
