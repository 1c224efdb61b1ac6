"""The quality table of the lossy options: its interval, its multiple-choice set and its log-likelihood scorer."""

from __future__ import annotations

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.bench.quality import mc_accuracy, wilson
from leapdecode.eval.lm_eval_task import wikitext_items


def test_wilson_interval():
    lo, hi = wilson(80, 100)
    assert lo == pytest.approx(0.7112, abs=1e-4) and hi == pytest.approx(0.8666, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_wikitext_items_are_four_endings_one_right(tmp_path):
    text = tmp_path / "w.txt"
    text.write_text("\n".join([" = Heading = "] + [" ".join(f"w{i}_{j}" for j in range(60)) for i in range(9)]))
    items = wikitext_items(text, 5, context_words=40, ending_words=8)
    assert len(items) == 5
    for i, item in enumerate(items):
        assert item["question"].split()[0] == f"w{i}_0" and len(item["question"].split()) == 40
        assert len(item["choices"]) == 4 and len(set(item["choices"])) == 4
        assert item["choices"][item["answer"]] == " " + " ".join(f"w{i}_{j}" for j in range(40, 48))
    assert wikitext_items(text, 5) == items  # seeded
    with pytest.raises(ValueError, match="paragraphs"):
        wikitext_items(text, 5, context_words=100)


def test_mc_accuracy_picks_the_highest_likelihood_choice(tiny_model_dir):
    """One-token choices: the model's own argmax has the highest log-likelihood, so it is always 'right'; put
    the answer index on another choice and it is always wrong."""
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64)
    tok = llm.get_tokenizer()
    items_right, items_wrong = [], []
    for q in ["a b c a b", "1 2 3 1 2", "the cat sat on the"]:
        ids = tok.encode(q, add_special_tokens=False)
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        best = out.outputs[0].token_ids[0]
        others = [t for t in torch.randperm(200).tolist() if t != best][:3]
        choices = [tok.decode([t]) for t in [best, *others]]
        if len({tuple(tok.encode(c, add_special_tokens=False)) for c in choices}) < 4 or \
                tok.encode(choices[0], add_special_tokens=False) != [best]:
            continue  # a choice that does not round-trip through the tokenizer as one token
        items_right.append({"question": q, "choices": choices, "answer": 0})
        items_wrong.append({"question": q, "choices": choices, "answer": 1})
    assert items_right
    assert mc_accuracy(llm, items_right) == len(items_right)
    assert mc_accuracy(llm, items_wrong) == 0
