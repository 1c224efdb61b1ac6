"""A small multiple-choice task for lm-evaluation-harness, to compare ``leapdecode serve`` (lm-eval's
``local-completions`` model, which scores each choice with ``echo`` + ``logprobs`` on ``/v1/completions``) with
lm-eval's own ``hf`` backend on the same weights.

Two tasks are built from the shared data. ``leapdecode_wikitext_continuation``: which of 4 endings continues a
WikiText-2 passage (the quality table of lossy options scores it, bench/quality.py). ``leapdecode_mt_bench_category``
labels MT-Bench's 80 first-turn questions with their category (8 choices):
``python -m leapdecode.eval.lm_eval_task --data ../shared/data --out /tmp/mc_task`` writes
``/tmp/mc_task/leapdecode_mt_bench_category.yaml`` and its JSONL, for ``lm_eval --include_path /tmp/mc_task
--tasks leapdecode_mt_bench_category ...`` (docs/server.md gives both commands).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
MT_BENCH_TASK = "leapdecode_mt_bench_category"


def write_task(folder: Path, name: str, items: list[dict[str, Any]]) -> Path:
    """Write ``items`` (``question``: the context, ``choices``: continuations, ``answer``: the right one's index) as
    the lm-eval task ``name`` in ``folder``; returns the YAML file."""
    for item in items:
        if not 0 <= item["answer"] < len(item["choices"]):
            raise ValueError(f"answer {item['answer']} is not an index into {item['choices']}")
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
    yaml = folder / f"{name}.yaml"
    yaml.write_text(TASK_YAML.format(name=name, data=json.dumps(str(data.resolve()))), encoding="utf-8")
    return yaml


def mt_bench_items(questions: Path) -> list[dict[str, Any]]:
    """Each MT-Bench question's first turn, to be labelled with its category."""
    rows = [json.loads(line) for line in questions.read_text(encoding="utf-8").splitlines() if line.strip()]
    categories = sorted({row["category"] for row in rows})
    return [
        {
            "question": f"Request: {row['turns'][0]}\nThe kind of request (one of {', '.join(categories)}) is:",
            "choices": [f" {c}" for c in categories],
            "answer": categories.index(row["category"]),
        }
        for row in rows
    ]


WIKITEXT_TASK = "leapdecode_wikitext_continuation"


def clean_wikitext(line: str) -> str:
    """A WikiText line with its tokenisation undone (`` @-@ `` -> ``-``, `` , `` -> ``, `` ...)."""
    for a, b in ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" , ", ", "), (" . ", ". "), (" 's", "'s"),
                 (" ; ", "; "), (" : ", ": "), ("( ", "("), (" )", ")"), (' " ', ' "')):
        line = line.replace(a, b)
    return line.strip()


def wikitext_items(path: Path, limit: int, context_words: int = 40, ending_words: int = 8,
                   num_choices: int = 4, seed: int = 0) -> list[dict[str, Any]]:
    """Which continuation follows the passage: the first ``context_words`` words of a WikiText paragraph, its
    next ``ending_words`` words as the right ending and the same span of ``num_choices - 1`` other paragraphs as
    the wrong ones (a cloze set a 135M model scores well above chance by log-likelihood). The right ending's
    place is drawn from ``seed``; the first ``limit`` usable paragraphs are used."""
    paras = [clean_wikitext(x).split() for x in path.read_text(encoding="utf-8").splitlines()
             if x.strip() and not x.strip().startswith("=")]
    paras = [p for p in paras if len(p) >= context_words + ending_words]
    if len(paras) < num_choices:
        raise ValueError(f"{path} has {len(paras)} paragraphs of {context_words + ending_words}+ words; need "
                         f"{num_choices}")
    rng = random.Random(seed)
    span = slice(context_words, context_words + ending_words)
    items = []
    for i, words in enumerate(paras[:limit]):
        others = rng.sample([j for j in range(len(paras)) if j != i], num_choices - 1)
        endings = [" " + " ".join(paras[j][span]) for j in others]
        answer = rng.randrange(num_choices)
        endings.insert(answer, " " + " ".join(words[span]))
        items.append({"question": " ".join(words[:context_words]), "choices": endings, "answer": answer})
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    parser.add_argument("--out", type=Path, required=True, help="folder for the task's YAML and JSONL")
    args = parser.parse_args(argv)
    yaml = write_task(args.out, MT_BENCH_TASK, mt_bench_items(args.data / "mt_bench" / "question.jsonl"))
    print(f"wrote {yaml}: lm_eval --include_path {args.out} --tasks {MT_BENCH_TASK} ...")
    yaml = write_task(args.out, WIKITEXT_TASK, wikitext_items(args.data / "wikitext2" / "valid.txt", 500))
    print(f"wrote {yaml}: lm_eval --include_path {args.out} --tasks {WIKITEXT_TASK} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
