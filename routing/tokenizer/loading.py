"""Loading a model's tokenizer from the files Hugging Face ships with it:
``tokenizer.json``, ``tokenizer_config.json`` (chat template, special tokens,
``add_bos_token``/``add_eos_token``), ``special_tokens_map.json`` and
``chat_template.jinja``, or a template file that replaces the model's (vLLM's
``--chat-template``). Unchanged files give the same object."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from routing.tokenizer.errors import TokenizerError
from routing.tokenizer.model_tokenizer import ModelTokenizer
from routing.tokenizer.prefix_cache import DEFAULT_CACHE_TOKENS

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"  # where transformers >= 4.47 saves the template

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    except ValueError as e:
        raise TokenizerError(f"{path}: invalid JSON: {e}") from None


def _token_text(v: Any) -> Any:
    """A special token as ``tokenizer_config.json`` writes it: a string, or an
    ``AddedToken`` object (``{"content": ...}``)."""
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return v


def _config_template(cfg: dict[str, Any], path: Path) -> str | None:
    t = cfg.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):  # named templates: the default one, as vLLM picks without a request override
        for item in t:
            if isinstance(item, dict) and item.get("name") == "default":
                template = item.get("template")
                if isinstance(template, str):
                    return template
        return None
    raise TokenizerError(f"{path}: `chat_template` must be a string or a list of {{name, template}}")


Versions = tuple[tuple[int, int] | None, ...]  # each file's (mtime ns, size), or None when absent

# (tokenizer.json, template file, cache bound) -> (the files' versions, the tokenizer)
_loaded: dict[tuple[str, str | None, int], tuple[Versions, ModelTokenizer]] = {}
_loaded_lock = threading.Lock()


def _versions(*paths: Path | None) -> Versions:
    """Each file's (mtime, size), or ``None`` when absent: what says a file changed."""
    out = []
    for p in paths:
        try:
            st = p.stat() if p is not None else None
        except OSError:
            st = None
        out.append((st.st_mtime_ns, st.st_size) if st is not None else None)
    return tuple(out)


def load_tokenizer(path: str | os.PathLike[str], chat_template: str | os.PathLike[str] | None = None,
                   cache_tokens: int = DEFAULT_CACHE_TOKENS) -> ModelTokenizer:
    """Load a model's tokenizer from ``path``: a ``tokenizer.json`` file, or a
    directory holding ``tokenizer.json`` and optionally ``tokenizer_config.json``
    (chat template, special tokens, ``add_bos_token``/``add_eos_token``),
    ``special_tokens_map.json`` and ``chat_template.jinja``. ``chat_template``: a
    file whose text replaces the model's template (vLLM's ``--chat-template``).

    The same unchanged files give the same object (loaded once: config validation,
    start-up and reload share it). Raises :class:`TokenizerError` naming the file.
    """
    p = Path(path)
    if p.is_dir():
        tok_json = p / TOKENIZER_JSON
        cfg_path: Path | None = p / TOKENIZER_CONFIG
        if not tok_json.is_file():
            raise TokenizerError(f"{p}: no {TOKENIZER_JSON} in this directory")
    elif p.is_file():
        tok_json, cfg_path = p, None
    else:
        raise TokenizerError(f"{p}: no such file or directory")
    tpl_path = Path(chat_template) if chat_template is not None else None
    extra = (p / "special_tokens_map.json", p / CHAT_TEMPLATE_JINJA) if cfg_path is not None else (None, None)
    key = (str(tok_json), str(tpl_path) if tpl_path is not None else None, cache_tokens)
    versions = _versions(tok_json, cfg_path, tpl_path, *extra)
    with _loaded_lock:
        hit = _loaded.get(key)
        if hit is not None and hit[0] == versions:
            return hit[1]
        tok = _load(tok_json, cfg_path, tpl_path, cache_tokens)
        _loaded[key] = (versions, tok)  # replaces an older version of the same files
        return tok


def _load(tok_json: Path, cfg_path: Path | None, tpl_path: Path | None, cache_tokens: int) -> ModelTokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(tok_json))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
        _read_json(tok_json)  # raises with a clear message when the file is not JSON at all
        raise TokenizerError(f"{tok_json}: not a valid tokenizers tokenizer: {e}") from None
    cfg: dict[str, Any] = {}
    template: str | None = None
    special: dict[str, Any] = {}
    add_bos = add_eos = None
    if cfg_path is not None:
        if cfg_path.is_file():
            loaded = _read_json(cfg_path)
            if not isinstance(loaded, dict):
                raise TokenizerError(f"{cfg_path}: a JSON object is expected")
            cfg = loaded
            template = _config_template(cfg, cfg_path)
        stm = cfg_path.parent / "special_tokens_map.json"
        overlay = _read_json(stm) if stm.is_file() else {}
        for name in _SPECIAL_NAMES:
            v = _token_text(overlay.get(name, cfg.get(name)))
            if isinstance(v, str):
                special[name] = v
        extra = overlay.get("additional_special_tokens", cfg.get("additional_special_tokens"))
        if isinstance(extra, list):
            special["additional_special_tokens"] = [_token_text(v) for v in extra]
        if isinstance(cfg.get("add_bos_token"), bool):
            add_bos = cfg["add_bos_token"]
        if isinstance(cfg.get("add_eos_token"), bool):
            add_eos = cfg["add_eos_token"]
        jinja_file = cfg_path.parent / CHAT_TEMPLATE_JINJA
        if template is None and jinja_file.is_file():
            template = _read_text(jinja_file)
    if tpl_path is not None:
        template = _read_text(tpl_path)
    return ModelTokenizer(tokenizer, template, special, add_bos_token=add_bos, add_eos_token=add_eos,
                          cache_tokens=cache_tokens, source=str(tok_json.parent if cfg_path else tok_json))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text: {e}") from None
