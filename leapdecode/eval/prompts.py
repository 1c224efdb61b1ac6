"""The shared data folder and its benchmark prompt sets (MT-Bench, grounded, mixed, agentic: held out from the
drafters' training data), and the agent sessions of ``bench --prompts agent_loop``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


def shared_data_dir() -> Path:
    """``$LEAPDECODE_DATA`` or the ``shared/data`` folder beside the repository checkout."""
    env = os.environ.get("LEAPDECODE_DATA")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for parent in here.parents:
        cand = parent.parent / "shared" / "data"
        if cand.is_dir():
            return cand
    return Path.cwd().parent / "shared" / "data"


def train_prompts_path() -> Path:
    """The shared data's training prompts: what the drafters' trainers read by default (never a benchmark set)."""
    return shared_data_dir() / "prompts" / "train_prompts.jsonl"


def load_questions(path: Path, limit: int | None) -> list[str]:
    """First turns of a Spec-Bench / MT-Bench style ``question.jsonl`` (``turns``), or ``prompt`` records."""
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} not found (set LEAPDECODE_DATA or pass --prompts PATH)")
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            text = rec["turns"][0] if "turns" in rec else rec.get("prompt") or rec.get("text")
            if not text:
                raise ValueError(f"{path}: a record has neither 'turns' nor 'prompt'")
            out.append(text)
            if limit and len(out) >= limit:
                break
    return out


def grounded_prompts(limit: int | None, passage_words: int = 300) -> list[str]:
    """Input-grounded tasks built from WikiText-2 validation paragraphs: summarise, or answer from the passage.
    The answer copies heavily from the input, which is where prompt lookup shines."""
    path = shared_data_dir() / "wikitext2" / "valid.txt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (set LEAPDECODE_DATA)")
    paras = []
    for line in open(path, encoding="utf-8"):
        line = line.strip()
        if line.startswith("=") or len(line.split()) < 120:
            continue
        text = " ".join(line.split()[:passage_words])
        text = text.replace(" @-@ ", "-").replace(" @,@ ", ",").replace(" @.@ ", ".").replace(" , ", ", ")
        text = text.replace(" . ", ". ").replace(" 's", "'s")
        paras.append(text)
    tasks = [
        "Summarize the following passage in a few sentences, reusing its wording.\n\n{p}",
        "Read the passage and list every name, place and date it mentions, quoting the passage.\n\n{p}",
        "Rewrite the following passage as a bulleted list of its key facts, quoting it closely.\n\n{p}",
    ]
    out = [tasks[i % len(tasks)].format(p=p) for i, p in enumerate(paras)]
    return out[:limit] if limit else out


AGENT_SYSTEM = """You are a coding agent working in a Python repository. Tools you can call:
- read_file(path): returns the file's text.
- write_file(path, text): replaces the file's text.
- run_tests(path): runs the file's doctests and returns the failures.
Answer with the complete new version of the function you edit, in one Python code block, then one line saying
what changed. Keep every line you do not need to change exactly as it was."""
AGENT_EDITS = [
    "Add a check at the top that raises TypeError with a clear message when an argument has the wrong type.",
    "Rename the local variables to longer descriptive names, changing nothing else.",
    "Add a short comment above every loop and every return saying what it does.",
]


AGENT_LOOP = "agent_loop"  # the name of agent_sessions' workload in ``leapdecode bench --prompts``


@dataclass(frozen=True)
class AgentSession:
    """One coding agent's session over one file: the system prompt, then user turns; the model's answer to each
    turn joins the conversation before the next, so every request repeats the whole session so far."""

    system: str
    turns: tuple[str, ...]


def _humaneval_functions() -> list[tuple[str, str]]:
    """(entry point, prompt + canonical solution) of every shared HumanEval problem."""
    path = shared_data_dir() / "code" / "humaneval.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (set LEAPDECODE_DATA)")
    out = []
    for line in open(path, encoding="utf-8"):
        rec = json.loads(line)
        out.append((rec["entry_point"], rec["prompt"] + rec["canonical_solution"]))
    return out


def agent_sessions(limit: int | None) -> list[AgentSession]:
    """Agent sessions over HumanEval functions, ``limit`` requests in all (the last session may be cut short):
    the agent reads a file, is asked for an edit, writes its answer back and is asked for the next edit of the
    version it wrote, ``len(AGENT_EDITS)`` turns a session."""
    out: list[AgentSession] = []
    left = limit
    for name, code in _humaneval_functions():
        if left == 0:
            break
        turns = [f"[tool call] read_file(\"src/{name}.py\")\n[tool result]\n```python\n{code}```\n\n"
                 f"Task: {AGENT_EDITS[0]}"]
        turns += [f"[tool call] write_file(\"src/{name}.py\", <your answer>)\n[tool result] written\n\nTask: {e}"
                  for e in AGENT_EDITS[1:]]
        if left is not None:
            turns, left = turns[:left], left - min(left, len(turns))
        out.append(AgentSession(AGENT_SYSTEM, tuple(turns)))
    return out


def agentic_prompts(limit: int | None) -> list[str]:
    """An agent loop's requests over HumanEval functions: every request repeats the same system prompt and tool
    descriptions, pastes the function back (as a read_file result) and asks for an edit; the next request about
    the same file pastes the previous request's function again with the next edit, so most of every answer is a
    copy of text the request (and earlier requests) already hold. The previous answer is the reference solution
    here, not the model's own output: a prompt set is fixed before any model runs (``agent_sessions`` is the loop
    that feeds the model's own answers back)."""
    out = []
    for name, code in _humaneval_functions():
        for turn, edit in enumerate(AGENT_EDITS[:2]):
            history = "" if turn == 0 else (f"[earlier in this session you edited {name} with: "
                                            f"{AGENT_EDITS[turn - 1]}]\n")
            out.append(f"{AGENT_SYSTEM}\n\n{history}[tool call] read_file(\"src/{name}.py\")\n[tool result]\n"
                       f"```python\n{code}```\n\nTask: {edit}")
            if limit and len(out) >= limit:
                return out
    return out


def load_prompt_set(name: str, limit: int | None) -> list[str]:
    data = shared_data_dir()
    if name == AGENT_LOOP:
        raise ValueError(f"{AGENT_LOOP} is a workload of agent sessions (each turn waits for the answer to the one "
                         f"before), not a set of prompts: `leapdecode bench --prompts {AGENT_LOOP}` runs it")
    if name == "mt_bench":
        return load_questions(data / "mt_bench" / "question.jsonl", limit)
    if name == "grounded":
        return grounded_prompts(limit)
    if name == "agentic":
        return agentic_prompts(limit)
    if name == "mixed":  # a mixed workload: grounded prompts and MT-Bench first turns, alternating
        half = None if limit is None else (limit + 1) // 2
        pairs = zip(grounded_prompts(half), load_questions(data / "mt_bench" / "question.jsonl", half))
        out = [p for pair in pairs for p in pair]
        return out[:limit] if limit else out
    return load_questions(Path(name), limit)
