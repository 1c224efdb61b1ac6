"""A scored task set with an automatic checker: HumanEval-style problems whose completions are run against their
tests (``leapdecode bench --report --code-tasks N``).

Each completion runs in a fresh Python subprocess with a time limit, in a temporary directory; the test passes
when the process exits 0. The programs are the model's output: run reports only on a machine where executing
generated code is acceptable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams

# where a function body ends in HumanEval completions (the next top-level statement)
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert "]
TIMEOUT_S = 10.0


def load_code_tasks(path: Path, limit: int) -> list[dict]:
    """The first ``limit`` records (``prompt``, ``test``, ``entry_point``) of a HumanEval jsonl; none when
    ``limit`` is 0. A missing file is an error that names it."""
    if limit <= 0:
        return []
    if not path.is_file():
        raise ValueError(f"--code-tasks needs a HumanEval-style jsonl at {path} (or pass --code-file PATH)")
    tasks = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            missing = {"prompt", "test", "entry_point"} - set(rec)
            if missing:
                raise ValueError(f"{path}: a record lacks {sorted(missing)}")
            tasks.append(rec)
        if len(tasks) == limit:
            break
    return tasks


def passes(program: str) -> bool:
    """Whether ``program`` exits 0 within ``TIMEOUT_S`` in a fresh interpreter, in a scratch directory."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r = subprocess.run([sys.executable, "-c", program], cwd=tmp, capture_output=True, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


def code_pass_rate(llm: LLM, tasks: list[dict], max_tokens: int) -> str:
    """Greedy completions of every task's prompt (raw text), each run with its tests: ``"passed/total"``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=STOP)
    outs = llm.generate([t["prompt"] for t in tasks], params, use_tqdm=False)
    passed = sum(passes(t["prompt"] + o.outputs[0].text + "\n\n" + t["test"] + f"\n\ncheck({t['entry_point']})\n")
                 for t, o in zip(tasks, outs))
    return f"{passed}/{len(tasks)}"


__all__ = ["code_pass_rate", "load_code_tasks", "passes"]
