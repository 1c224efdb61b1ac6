"""Incremental detokenization (engine/detokenizer.py): the text built token by token equals one decode of all of
them, on the bundled tokenizer, whatever the steps' sizes; stop strings are still found where they start."""

from __future__ import annotations

import random

import pytest

from leapdecode.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld ✓ 你好 🤖🎨 naïve café — “quotes” and ‘single’ ones",
    "def f(x):\n    return x ** 2  # squared\n\n\tprint(f(3))",
    "   leading spaces, trailing ones   ",
    "数字 1234567890 and emoji 👩‍💻 joined",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_text_equals_a_full_decode(tokenizer, seed: int) -> None:
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(seed)
    special = tokenizer.all_special_ids
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        ids = ids[:3] + [special[0]] + ids[3:]  # a special token mid-stream decodes to nothing
        d = IncrementalDetokenizer(decode)
        pieces, n = [], 0
        while n < len(ids):
            n = min(len(ids), n + rng.choice([1, 1, 2, 3]))  # accepted drafts add several tokens at once
            pieces.append(d.append(ids[:n]))
            assert decode(ids[:n]).startswith(d.text)  # never ahead of, never different from the truth
        assert d.text == "".join(pieces) == decode(ids)
        assert d.finish(ids) == decode(ids)


def test_unfinished_character_waits_and_finish_repairs(tokenizer) -> None:
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode("a 🤖", add_special_tokens=False)
    assert decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span tokens
    d = IncrementalDetokenizer(decode)
    d.append(ids[:-1])
    assert "\ufffd" not in d.text  # nothing half-made is shown
    d.append(ids)
    assert d.text == "a 🤖"
    d2 = IncrementalDetokenizer(decode)
    d2.append(ids[:-1])
    assert d2.finish(ids[:-1]) == decode(ids[:-1])  # a sequence that ends mid-character keeps its bytes


def test_stop_string_across_tokens_is_cut_where_it_starts(tiny_model_dir) -> None:
    from leapdecode import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    free = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    text = free[0].outputs[0].text
    assert len(text) > 12
    stop = text[5:11]  # likely spans a token boundary; the first occurrence is what must be cut at
    cut = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop=[stop]))  # fmt: skip
    out = cut[0].outputs[0]
    assert out.text == text[: text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
