"""A small multiple-choice task for lm-evaluation-harness, to compare ``leapdecode serve`` (lm-eval's
``local-completions`` model, which scores each choice with ``echo`` + ``logprobs`` on ``/v1/completions``) with
lm-eval's own ``hf`` backend on the same weights.

The task built from the shared data labels MT-Bench's 80 first-turn questions with their category (8 choices):
``python -m leapdecode.eval.lm_eval_task --data ../shared/data --out /tmp/mc_task`` writes
``/tmp/mc_task/leapdecode_mt_bench_category.yaml`` and its JSONL, for ``lm_eval --include_path /tmp/mc_task
--tasks leapdecode_mt_bench_category ...`` (docs/server.md gives both commands).
"""

from __future__ import annotations

import argparse
import json
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"), help="the shared data folder")
    parser.add_argument("--out", type=Path, required=True, help="folder for the task's YAML and JSONL")
    args = parser.parse_args(argv)
    yaml = write_task(args.out, MT_BENCH_TASK, mt_bench_items(args.data / "mt_bench" / "question.jsonl"))
    print(f"wrote {yaml}: lm_eval --include_path {args.out} --tasks {MT_BENCH_TASK} ...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
