"""routing/tokenizer/: a model's own tokenizer and chat template, without sockets.

The tokenizer is the real byte-level BPE of the real-engine suite's tiny model
(``tests/support/data/tiny-tokenizer``: ``scripts/tokenizer.json`` and the ChatML template
``scripts/make_tiny_model.py`` writes). Parity with a real engine's token ids is in
``tests/engines/test_tokenizer_engine.py``.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer

from loadtest.sim.prompt import render_chat as sim_render_chat
from routing.core import BackendSpec, DecisionCore
from routing.tokenizer import ModelTokenizer, TokenizerError, Unsupported, load_tokenizer
from routing.tokenizer.prefix_cache import _SEPARABLE_SPLITS, CHUNK_CHARS, MIN_SEGMENT_CHARS, OFFLOAD_CHARS
from tests.support.chat_cases import TINY, TOOLS_TEMPLATE

TINY_JSON = json.loads((TINY / "tokenizer.json").read_text())
TINY_CONFIG = json.loads((TINY / "tokenizer_config.json").read_text())
CHATML = TINY_CONFIG["chat_template"]
SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def fresh(template: str | None = CHATML, tokenizer_json: dict | None = None, **kw) -> ModelTokenizer:
    """A tokenizer of its own (its own prefix cache and counters)."""
    tok = Tokenizer.from_str(json.dumps(tokenizer_json or TINY_JSON))
    return ModelTokenizer(tok, template, SPECIAL, **kw)


def ids(tok: ModelTokenizer, endpoint: str, data: dict) -> list[int]:
    return list(tok.tokenization(endpoint, data).token_ids())


WORDS = ["hello", "world", " ", "  ", "\n", "\n\n", "\t", "Zürich", "世界", "🙂", "naïve", "a", "'s", "123", "4.5",
         "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start", "im_end|>", "<", "|", "x" * 80, " " * 70,
         "def f(x):\n    return x\n", "é" * 40]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60)))


# ---- the prefix cache gives the ids of one whole encoding --------------------------------

def test_cached_segments_concatenate_to_the_whole_encoding():
    tok = fresh()
    rng = random.Random(18)
    texts = [random_text(rng) for _ in range(300)]
    texts += [t[:n] for t in texts[:50] for n in (1, len(t) // 2)]  # prefixes, then the whole again
    for text in texts + texts:  # the second pass comes from the cache
        for add_special in (False, True):
            got = list(tok.text_tokenization(text, add_special).token_ids())
            assert got == tok.encode(text, add_special), repr(text)
    assert tok.cache.hits > 0 and len(tok.cache) > 0


def _family(name: str) -> Tokenizer:
    """A small tokenizer of another family, trained here: SentencePiece-style BPE
    (Metaspace, as Llama 2 and Mistral), Unigram with a prepending normalizer, BERT's
    WordPiece with a lower-casing normalizer and [CLS]/[SEP]-style specials."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    rng = random.Random(3)
    corpus = [random_text(rng) for _ in range(300)]
    specials = ["<s>", "</s>", "[INST]", "[/INST]", "<unk>"]
    if name.startswith("metaspace"):
        scheme = name.split("-")[1]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        tok.decoder = decoders.Metaspace(prepend_scheme=scheme)
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            show_progress=False))
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", tok.token_to_id("<s>"))])
    elif name == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "\u2581"),
                                               normalizers.Prepend("\u2581")])
        tok.train_from_iterator(corpus[:40], trainers.UnigramTrainer(vocab_size=200, special_tokens=specials,
                                                                     unk_token="<unk>", max_piece_length=8,
                                                                     show_progress=False))
    else:
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=600, special_tokens=specials,
                                                                  show_progress=False))
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


@pytest.mark.parametrize("family", ["metaspace-first", "metaspace-always", "unigram", "wordpiece"])
def test_cached_segments_are_exact_for_other_tokenizer_families(family):
    tok = ModelTokenizer(_family(family), None, {})
    assert tok._cuts is not None and "INST" in tok._cuts.pattern
    rng = random.Random(4)
    texts = ["[INST]" + random_text(rng) + "[/INST]" + random_text(rng) + "</s><s>[INST] " + random_text(rng)
             for _ in range(100)]
    for text in texts + texts:
        for add_special in (False, True):
            assert list(tok.text_tokenization(text, add_special).token_ids()) == tok.encode(text, add_special), text
    assert tok.cache.hits > len(texts)


def test_a_conversations_next_turn_encodes_only_its_new_text():
    tok = fresh()
    system = {"role": "system", "content": "You answer questions about Zürich. " * 60}
    convo = [system, {"role": "user", "content": "Where is the lake? 🙂"}]
    first = tok.tokenization("chat", {"messages": convo})
    assert first.uncached_chars == len(tok.render_chat({"messages": convo}))
    first.token_ids()
    convo += [{"role": "assistant", "content": "South of the old town."},
              {"role": "user", "content": "And the airport, how far is it from there?"}]
    text = tok.render_chat({"messages": convo})
    second = tok.tokenization("chat", {"messages": convo})
    assert second.uncached_chars < len(text) - len(system["content"])  # the system prompt came from the cache
    assert list(second.token_ids()) == tok.encode(text, False)


def test_a_long_uncached_prompt_is_marked_for_the_executor():
    tok = fresh()
    long = tok.tokenization("completions", {"prompt": "word " * OFFLOAD_CHARS})
    short = tok.tokenization("completions", {"prompt": "word " * 10})
    assert long.offload and not short.offload
    long.encode()  # what the executor thread runs; the ids are then assembled on the caller's thread
    assert list(long.token_ids()) == tok.encode("word " * OFFLOAD_CHARS, True)


def test_no_cache_means_one_whole_encoding():
    tok = fresh(cache_tokens=0)
    data = {"messages": [{"role": "user", "content": "hello " * 50}]}
    tz = tok.tokenization("chat", data)
    assert tok.cache is None and tz.uncached_chars == len(tok.render_chat(data))
    assert list(tz.token_ids()) == tok.encode(tok.render_chat(data), False)


def test_the_cache_stays_within_its_bound():
    tok = fresh(cache_tokens=500)
    rng = random.Random(1)
    for _ in range(100):
        tok.text_tokenization("<|im_start|>" + random_text(rng) * 3, False).token_ids()
        assert tok.cache.tokens <= 500


def test_a_special_token_that_eats_the_space_before_it_is_no_cut_point():
    spec = json.loads(json.dumps(TINY_JSON))
    for t in spec["added_tokens"]:
        if t["content"] == "<|im_start|>":
            t["lstrip"] = True
    tok = fresh(tokenizer_json=spec)
    text = "x" * MIN_SEGMENT_CHARS + "   <|im_start|>user\nhi" + " " * 3 + "<|im_end|>\n"
    cut = text.index("<|im_start|>")
    # cutting before it would split the whitespace it absorbs from the text it follows
    assert tok.encode(text[:cut], False) + tok.encode(text[cut:], False) != tok.encode(text, False)
    assert "im_start" not in tok._cuts.pattern and "im_end" in tok._cuts.pattern
    assert list(tok.text_tokenization(text, False).token_ids()) == tok.encode(text, False)


# ---- long segments are cut into chunks where the tokenizer allows it ---------------------

def _split_byte_level(pattern: str) -> Tokenizer:
    """A byte-level BPE trained here with Llama 3's or Qwen 2's pre-tokenizer: Split on
    the regex, then ByteLevel without its own regex."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(7)
    tok.train_from_iterator([random_text(rng) for _ in range(300)], trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


CHUNKED = [("tiny byte-level BPE", lambda: Tokenizer.from_str(json.dumps(TINY_JSON)))] + [
    (f"Split regex {i}", lambda p=p: _split_byte_level(p)) for i, p in enumerate(sorted(_SEPARABLE_SPLITS))]


@pytest.mark.parametrize("name,make", CHUNKED, ids=[n for n, _ in CHUNKED])
def test_long_segments_cut_into_chunks_give_the_whole_encoding(name, make):
    tok = ModelTokenizer(make(), None, {})
    assert tok._chunk_cut is not None
    rng = random.Random(11)
    texts = [sep.join(random_text(rng) for _ in range(rng.randint(5, 40))) for sep in ("", " ") for _ in range(40)]
    texts += [t[:len(t) * 3 // 4] for t in texts[::4]]  # prefixes of texts cut into chunks already
    chunked = 0
    for text in texts + texts:
        tz = tok.text_tokenization(text, False)
        chunked += len(tz._parts) > 1
        assert list(tz.token_ids()) == tok.encode(text, False), repr(text)
    assert chunked > len(texts) and tok.cache.hits > len(texts)


@pytest.mark.parametrize("name,make", CHUNKED, ids=[n for n, _ in CHUNKED])
def test_every_chunk_cut_point_splits_the_encoding_exactly(name, make):
    tok = ModelTokenizer(make(), None, {})
    rng = random.Random(13)
    checked = 0
    for _ in range(150):
        text = rng.choice(("", " ")).join(random_text(rng) for _ in range(3))
        whole = tok.encode(text, False)
        cuts = [m.start() for m in tok._chunk_cut.finditer(text)]
        for p in rng.sample(cuts, min(len(cuts), 25)):
            assert tok.encode(text[:p], False) + tok.encode(text[p:], False) == whole, (text[:p], text[p:])
            checked += 1
    assert checked > 1000


def test_a_growing_message_encodes_only_its_last_chunk_and_the_new_text():
    tok = fresh()
    rng = random.Random(12)
    words = "".join(rng.choice([" hello", " world", " Zürich", " 123", " 世界", ",", ".\n", "  x"])
                    for _ in range(6000))
    first = {"messages": [{"role": "user", "content": words[:20_000]}]}
    tok.tokenization("chat", first).token_ids()
    grown = {"messages": [{"role": "user", "content": words[:22_000]}]}
    tz = tok.tokenization("chat", grown)
    assert tz.uncached_chars < 2_000 + 2 * CHUNK_CHARS  # not the 22,000 characters of the whole message
    assert list(tz.token_ids()) == tok.encode(tok.render_chat(grown), False)


@pytest.mark.parametrize("family", ["metaspace-first", "metaspace-always", "unigram", "wordpiece"])
def test_other_tokenizer_families_get_no_chunk_cuts(family):
    assert ModelTokenizer(_family(family), None, {})._chunk_cut is None


def test_an_added_token_that_strips_whitespace_turns_chunk_cuts_off():
    spec = json.loads(json.dumps(TINY_JSON))
    spec["added_tokens"][1]["rstrip"] = True
    assert fresh(tokenizer_json=spec)._chunk_cut is None and fresh()._chunk_cut is not None


# ---- special tokens: BOS from the post-processor, chat without it -------------------------

def with_bos_post_processor() -> dict:
    spec = json.loads(json.dumps(TINY_JSON))
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    return spec


def test_completions_get_the_post_processors_bos_and_chat_does_not():
    tok = fresh(tokenizer_json=with_bos_post_processor())
    assert tok.head == (0,) and tok.tail == ()
    got = ids(tok, "completions", {"prompt": "hello world"})
    assert got[0] == 0 and got == tok.encode("hello world", True)
    assert ids(tok, "completions", {"prompt": "hello world", "add_special_tokens": False}) \
        == tok.encode("hello world", False)
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    text = tok.render_chat(chat)
    assert ids(tok, "chat", chat) == tok.encode(text, False)  # vLLM: the template writes its own BOS
    assert ids(tok, "chat", {**chat, "add_special_tokens": True}) == tok.encode(text, True)


def test_tokenizer_configs_add_bos_token_decides_over_the_post_processor():
    assert fresh(tokenizer_json=with_bos_post_processor(), add_bos_token=False).head == ()
    assert fresh(add_bos_token=True).head == (0,)
    assert fresh(add_eos_token=True).tail == (2,)


# ---- completions -------------------------------------------------------------------------

def test_token_id_prompts_pass_through_unchanged():
    tok = fresh()
    assert ids(tok, "completions", {"prompt": [5, 9, 70000, 1]}) == [5, 9, 70000, 1]
    assert ids(tok, "completions", {"prompt": [[3, 4]]}) == [3, 4]
    assert ids(tok, "completions", {"prompt": ["hello"]}) == tok.encode("hello", True)
    assert ids(tok, "completions", {"prompt": "a b c d e", "truncate_prompt_tokens": 2}) \
        == tok.encode("a b c d e", True)[-2:]


@pytest.mark.parametrize("data", [
    {"prompt": ["one", "two"]},  # two prompts: two engine requests
    {"prompt": [1, -2]},
    {"prompt": [1, True]},
    {"prompt": None},
    {"prompt": "x", "prompt_embeds": "AAAA"},
    {"prompt": "lone \ud800 surrogate"},
])
def test_completions_that_cannot_be_reproduced(data):
    with pytest.raises(Unsupported):
        fresh().tokenization("completions", data)


# ---- chat rendering ----------------------------------------------------------------------

def test_chatml_render_and_text_parts():
    tok = fresh()
    data = {"messages": [{"role": "system", "content": "Be kind."},
                         {"role": "user", "content": [{"type": "text", "text": "Héllo"},
                                                      {"type": "text", "text": "世界"}]}]}
    assert tok.render_chat(data) == ("<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHéllo\n世界<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert tok.render_chat({**data, "add_generation_prompt": False}).endswith("世界<|im_end|>\n")
    # the simulated engine renders the same ChatML text, so its blocks are the gateway's
    assert sim_render_chat(data["messages"]) == tok.render_chat(data)


def test_continue_final_message_leaves_the_last_message_open():
    tok = fresh()
    data = {"messages": [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}],
            "add_generation_prompt": False, "continue_final_message": True}
    assert tok.render_chat(data).endswith("<|im_start|>assistant\none, two,")


@pytest.mark.parametrize("data", [
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ messages }}"},
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},  # with add_generation_prompt
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}},
    {"messages": [{"content": "no role"}]},
    {"messages": "hi"},
    {"messages": [{"role": "user", "content": "lone \udfff surrogate " * 10}]},
])
def test_chat_requests_that_cannot_be_reproduced(data):
    with pytest.raises(Unsupported):
        fresh().tokenization("chat", data)


def test_a_template_that_raises_gives_no_ids():
    tok = fresh(TOOLS_TEMPLATE.read_text())
    with pytest.raises(Unsupported, match="unknown role: critic"):
        tok.render_chat({"messages": [{"role": "critic", "content": "meh"}]})


def test_tools_and_tool_calls_render_as_vllm_passes_them():
    tok = fresh(TOOLS_TEMPLATE.read_text())
    text = tok.render_chat({
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c", "type": "function",
                          "function": {"name": "w", "arguments": "{\"city\": \"Zürich\"}"}}]},
                     {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "12 °C"}]}],
        "tools": [{"type": "function", "function": {"name": "w", "description": "a <b> & c"}}]})
    # tojson does not escape HTML; a tool's absent fields are null, as vLLM's pydantic dump has them;
    # arguments are parsed into an object, not left a JSON string
    assert '{"type": "function", "function": {"name": "w", "description": "a <b> & c", "parameters": null}}' in text
    assert '<call>w {"city": "Zürich"}</call>' in text
    assert "<|im_start|>tool\n12 °C<|im_end|>" in text


def test_transformers_jinja_environment():
    tpl = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson }}{% endfor %}\n"
           "  {% if true %}\n{{ bos_token }}|{{ strftime_now('%Y') | length }}|{% generation %}g{% endgeneration %}"
           "{{ flag }}\n  {% endif %}\n")
    tok = fresh(tpl)
    text = tok.render_chat({"messages": [{"role": "user", "content": "<a>"}, {"role": "user", "content": "never"}],
                            "chat_template_kwargs": {"flag": "!"}})
    # loopcontrols; tojson without HTML escapes; trim_blocks and lstrip_blocks; special tokens and
    # strftime_now as variables; the {% generation %} tag renders its body
    assert text == '"<a>"<|endoftext|>|4|g!\n'


def test_a_template_that_loops_over_content_gets_parts():
    tok = fresh("{% for m in messages %}{% for p in m['content'] %}[{{ p.type }}:{{ p.text }}]{% endfor %}{% endfor %}")
    assert tok.openai_content
    assert tok.render_chat({"messages": [{"role": "user", "content": "hi"}]}) == "[text:hi]"


# ---- loading -----------------------------------------------------------------------------

def test_load_a_model_directory_or_a_lone_tokenizer_json(tmp_path):
    tok = load_tokenizer(TINY)
    assert tok.chat_template == CHATML and tok.special_tokens["eos_token"] == "<|im_end|>"
    assert load_tokenizer(TINY) is tok  # unchanged files: loaded once
    lone = load_tokenizer(TINY / "tokenizer.json")
    assert lone.template is None
    with pytest.raises(Unsupported, match="no chat template"):
        lone.tokenization("chat", {"messages": [{"role": "user", "content": "hi"}]})
    assert load_tokenizer(TINY / "tokenizer.json", TOOLS_TEMPLATE).template is not None
    d = tmp_path / "model"
    d.mkdir()
    (d / "tokenizer.json").write_text((TINY / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<|endoftext|>"}}))
    (d / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}")
    first = load_tokenizer(d)
    assert first.render_chat({"messages": [{"role": "user", "content": "x"}]}) == "<|endoftext|>x"
    assert load_tokenizer(d) is first
    (d / "chat_template.jinja").write_text("{{ messages[0].content }}!")  # a changed file is read again
    again = load_tokenizer(d)
    assert again is not first and again.render_chat({"messages": [{"role": "user", "content": "x"}]}) == "x!"


@pytest.mark.parametrize("write,fragment", [
    (lambda d: None, "no tokenizer.json"),
    (lambda d: (d / "tokenizer.json").write_text("{not json"), "invalid JSON"),
    (lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "not a valid tokenizers tokenizer"),
    (lambda d: ((d / "tokenizer.json").write_text(json.dumps(TINY_JSON)),
                (d / "tokenizer_config.json").write_text('{"chat_template": "{% for %}"}')),
     "chat template syntax error"),
    (lambda d: ((d / "tokenizer.json").write_text(json.dumps(TINY_JSON)),
                (d / "tokenizer_config.json").write_text('[1]')), "a JSON object is expected"),
])
def test_bad_tokenizer_files_are_named(tmp_path, write, fragment):
    write(tmp_path)
    with pytest.raises(TokenizerError, match=fragment):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(tmp_path / "absent")


# ---- the decision core ---------------------------------------------------------------------

def test_the_core_counts_exact_tokens_only_for_a_model_with_a_tokenizer():
    tok = fresh()
    core = DecisionCore([BackendSpec("a", frozenset({"m", "plain"}))], "estimated_ttft")
    core.apply([BackendSpec("a", frozenset({"m", "plain"}))], "estimated_ttft", {}, {"m": tok})
    data = {"messages": [{"role": "user", "content": "hello there " * 40}]}
    text = "<|user|>\n" + "hello there " * 40 + "\n"
    assert core.tokenization("plain", "chat", data) is None
    est_plain, req_plain = core.request("plain", text, 16)
    assert req_plain.token_ids is None and est_plain.prompt_tokens == core.prompt_tokens("plain", text)
    tz = core.tokenization("m", "chat", data)
    token_ids = tz.token_ids()
    est, req = core.request("m", text, 16, token_ids=token_ids)
    assert est.prompt_tokens == len(token_ids) == len(tok.encode(tok.render_chat(data), False))
    assert req.token_ids is token_ids and req.prompt_tokens == len(token_ids)
    assert est.hashes == core.request("m", text, 16)[0].hashes  # the approximate index keeps its byte blocks
    assert core.tokenization("m", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}) is None
    st = core.tokenize_stats["m"]
    assert (st.exact, st.unsupported, st.prompt_tokens) == (1, 1, len(token_ids))
