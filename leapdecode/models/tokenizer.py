"""The tokenizer of an HF folder or of a GGUF file's embedded vocabulary (converted once, then cached), and a
conversation through its chat template as token ids."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from leapdecode.models.gguf_file import GGUFFile
from leapdecode.models.loader import gguf_field

# private-use characters around a message index while a chat template is rendered for escaping
PLACEHOLDER_OPEN, PLACEHOLDER_CLOSE = "\ue000", "\ue001"


def tokenizer_cache_dir(path: Path) -> Path:
    """Where the HF tokenizer converted from a GGUF file is kept: converting a 49k-token vocabulary takes
    seconds, loading the saved one a fraction of that. Keyed by the file's path, size and modification time and
    the transformers version, so a changed file or converter is converted again."""
    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    root = Path(os.environ.get("LEAPDECODE_CACHE", Path.home() / ".cache" / "leapdecode"))
    return root / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:16]


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    cache = tokenizer_cache_dir(path)
    if (cache / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache))
        except (OSError, ValueError):
            pass  # a damaged cache entry: convert again below
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if getattr(tok, "chat_template", None) is None:
        template = gguf_field(GGUFFile(path), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    try:  # written to a private folder, then renamed: a concurrent or killed run never sees half a tokenizer
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache.parent))
        tok.save_pretrained(str(tmp))
        try:
            os.replace(tmp, cache)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home: convert on every load
    return tok


def load_tokenizer(path: Path):
    """HF tokenizer (with chat template) from an HF folder or from a GGUF's embedded vocabulary (converted once,
    then read from :func:`tokenizer_cache_dir`)."""
    import logging

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    return _gguf_tokenizer(path)


NO_CHAT_TEMPLATE = ("this model has no chat template (a base model's checkpoint often has none): pass one as "
                    "chat_template= (LLM.chat) or --chat-template (leapdecode chat / serve), or send plain text "
                    "(LLM.generate, /v1/completions)")

# apply_chat_template's own arguments: not template variables a caller may set
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "messages",
})


def chat_token_ids(
    tokenizer,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    escape_special_tokens: bool = False,
    chat_template: str | None = None,
) -> list[int]:
    """``conversation`` through the tokenizer's chat template (or ``chat_template``, a Jinja template in its place),
    ready for the assistant's turn, as token ids (newer transformers return a BatchEncoding here, older ones a
    list). ``tools``: OpenAI-style function definitions the template may show the model; ``template_kwargs``:
    extra template variables (e.g. ``enable_thinking``).

    As in HF transformers and vLLM, a special token's text inside a message (``"<|im_end|>"``) becomes that control
    token by default. ``escape_special_tokens`` tokenizes every message's text as plain text instead (the template's
    own special tokens stay): the template is rendered around placeholders and each text is tokenized on its own
    with special tokens split, so a token may differ from the default's where a text meets the template."""
    extra = dict(template_kwargs or {})
    clash = sorted(k for k in extra if k in RESERVED_TEMPLATE_KWARGS or not str(k).isidentifier())
    if clash:
        raise ValueError(f"chat template variables {clash} are not allowed (names of the template call's own "
                         "arguments, or not identifiers)")
    if chat_template:
        extra["chat_template"] = chat_template
    elif not getattr(tokenizer, "chat_template", None):
        raise ValueError(NO_CHAT_TEMPLATE)
    if escape_special_tokens:
        return _escaped_chat_token_ids(tokenizer, conversation, tools, extra)
    ids = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=True, tokenize=True,
                                        **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _escaped_chat_token_ids(tokenizer, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            extra: dict[str, Any]) -> list[int]:
    texts: list[str] = []
    masked = []
    for m in conversation:
        if isinstance(m.get("content"), str) and m["content"]:
            masked.append({**m, "content": f"{PLACEHOLDER_OPEN}{len(texts)}{PLACEHOLDER_CLOSE}"})
            texts.append(m["content"])
        else:
            masked.append(m)
    rendered = tokenizer.apply_chat_template(masked, tools=tools, add_generation_prompt=True, tokenize=False, **extra)
    pieces = re.split(f"{PLACEHOLDER_OPEN}(\\d+){PLACEHOLDER_CLOSE}", rendered)
    found = [int(i) for i in pieces[1::2]]
    if found != list(range(len(texts))):  # the template dropped, repeated or reordered a message's text
        raise ValueError("escape_special_tokens: this chat template does not show each message's text once, "
                         "in order; it cannot be escaped")
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += tokenizer.encode(piece, add_special_tokens=False) if piece else []
        else:
            ids += tokenizer.encode(texts[int(piece)], add_special_tokens=False, split_special_tokens=True)
    return ids
