"""Start-up calibration of the int8 KV cache's key transform (kv_quant.py: ``T(k) = ((k - mu) / s) @ R``).

The keys' per-channel mean ``mu`` and spread ``s`` are properties of the model, not of a prompt: a few hundred
tokens of ordinary text pin them down. The engine runs the texts below through the model once, with the cache
observing every key it is asked to store, sets ``mu`` and ``s`` and frees the blocks -- before the first request,
since keys stored under one transform cannot be read under another. It takes ~1 s for SmolLM2-135M on 2 CPU
cores. ``EngineConfig.kv_calibration=False`` skips it (``mu = 0``, ``s = 1``: rotation and grouped scales only).

The texts are written for this purpose (chat turns for instruction-tuned models, plus prose, code and numbers);
none comes from a benchmark, so calibrating never sees evaluation prompts.
"""

from __future__ import annotations

from typing import Any

import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.models.tokenizer import chat_token_ids

CHAT_TURNS: tuple[str, ...] = (
    "I keep forgetting to water my plants. Can you suggest a simple routine that works for a busy week?",
    "Explain the difference between a list and a tuple in Python, with a short example of when to use each.",
    "Write a friendly two-paragraph email asking a colleague to review my project proposal by Friday.",
    "What are the main causes of inflation, and how do central banks usually respond to it?",
)

PLAIN_TEXTS: tuple[str, ...] = (
    "The river bent sharply to the west before it reached the old mill, and in spring the water rose high enough "
    "to cover the lowest step of the stone stairs. Children from the village used to race paper boats there, "
    "counting how long each one took to vanish under the bridge.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be positive')\n"
    "    total = sum(values[:window])\n    out = [total / window]\n    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n        out.append(total / window)\n    return out\n",
    "Quarterly revenue grew 7.4% to $18.2 million, while operating costs fell from $11.9 million to $11.1 million. "
    "The board approved a dividend of 0.35 per share, payable on 14 March to holders of record on 28 February.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, oxygen is "
    "released, and the energy captured is stored in sugars that the plant uses to grow and repair its tissues.",
)


def calibration_token_lists(tok: Any) -> list[list[int]]:
    """The calibration texts as token ids for the transformers tokenizer ``tok``: chat turns through the model's
    chat template when it has one."""
    lists = []
    if getattr(tok, "chat_template", None):
        lists += [chat_token_ids(tok, [{"role": "user", "content": turn}]) for turn in CHAT_TURNS]
    else:
        lists += [tok.encode(t) for t in CHAT_TURNS]
    lists += [tok.encode(t) for t in PLAIN_TEXTS]
    return [ids for ids in lists if len(ids) >= 2]


@torch.inference_mode()
def calibrate_int8_keys(runner: ModelRunner, kv: KVCache, bm: BlockManager, token_lists: list[list[int]],
                        max_tokens: int) -> int:
    """Prefill each token list (cut to ``max_tokens``, the longest pass the engine runs) into blocks borrowed from
    ``bm`` through ``runner`` with ``kv`` observing keys, then set the cache's key shift and smoothing; returns the
    number of key rows observed per layer. Lists longer than the free KV space are cut too. The engine passes its
    runner, cache and block manager, not itself: calibration needs nothing else of it."""
    if bm.num_free_blocks != bm.num_blocks:
        raise RuntimeError("calibrate the int8 KV cache before it holds any tokens")
    cap = min(max_tokens, bm.num_free_blocks * bm.block_size)
    kv.observe_keys(True)
    try:
        for ids in token_lists:
            ids = list(ids)[:cap]
            if not ids:
                continue
            with bm.borrowed(len(ids), "KV calibration") as table:
                runner.execute([ForwardItem(table, 0, ids, [len(ids) - 1])])
    except BaseException:
        kv.observe_keys(False)
        raise
    return kv.calibrate_keys()
