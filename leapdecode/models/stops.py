"""The tokens that end a generation: the model's end of sequence and, for instruct models, its end of turn.

An instruct model ends its answer with the token its chat template writes after an assistant turn (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``...), which is not always the vocabulary's end-of-sequence token. The ids come from
every place a checkpoint declares them:

* GGUF metadata: ``tokenizer.ggml.eos_token_id``, ``eot_token_id`` (end of turn) and ``eom_token_id`` (end of message,
  Llama 3.1's tool turns): :func:`gguf_end_ids`.
* An HF folder's ``config.json`` and ``generation_config.json`` (whose ``eos_token_id`` is often a list):
  :func:`hf_end_ids`.
* The tokenizer's own ``eos_token_id`` and the special token the chat template writes right after an assistant
  message's content: :func:`template_end_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GGUF_END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_PROBE = "\x01leapdecode-end-probe\x01"  # an assistant message's content nobody writes


def as_id_list(value: Any) -> list[int]:
    """An ``eos_token_id`` field (an id, a list of ids or nothing) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if isinstance(v, int)]


def unique(ids: Iterable[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    return out


def gguf_end_ids(fields: dict[str, Any]) -> list[int]:
    """End-of-sequence, end-of-turn and end-of-message ids of a GGUF file's metadata (``fields``: key -> value)."""
    ids = []
    for key in GGUF_END_KEYS:
        v = fields.get(key)
        if v is not None:
            ids.append(int(v.item() if hasattr(v, "item") else v))
    return unique(ids)


def hf_end_ids(folder: Path, config: dict[str, Any]) -> list[int]:
    """``config.json``'s ``eos_token_id`` and ``generation_config.json``'s (which generation stops on in HF)."""
    ids = as_id_list(config.get("eos_token_id"))
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            ids += as_id_list(json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, OSError):
            pass  # an unreadable generation config adds nothing; config.json's ids stand
    return unique(ids)


def template_end_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's ``eos_token_id`` and the special token the chat template writes right after an assistant
    message's content (none when there is no template, it cannot render a two-turn chat, or what follows the
    content is plain text)."""
    ids = as_id_list(getattr(tokenizer, "eos_token_id", None))
    if not getattr(tokenizer, "chat_template", None):
        return ids
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        rendered = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # a template with rules of its own (roles, system turns): no end token learnt from it
        return ids
    at = rendered.find(_PROBE) if isinstance(rendered, str) else -1
    if at < 0:
        return ids
    tail = tokenizer.encode(rendered[at + len(_PROBE) :], add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", ())) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    if tail and tail[0] in special:
        ids.append(tail[0])
    return unique(ids)
