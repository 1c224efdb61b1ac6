"""Benchmark prompt sets built from the shared data folder (skipped where it is absent)."""

from __future__ import annotations

import pytest

from leapdecode.eval.prompts import AGENT_EDITS, AGENT_SYSTEM, load_prompt_set, shared_data_dir


@pytest.mark.skipif(not (shared_data_dir() / "code" / "humaneval.jsonl").is_file(), reason="no shared data")
def test_agentic_requests_share_the_system_prompt_and_paste_the_function_back():
    prompts = load_prompt_set("agentic", 6)
    assert len(prompts) == 6
    assert all(p.startswith(AGENT_SYSTEM) for p in prompts)
    # two requests per file: the same function pasted back, the second one after the first one's edit
    first, second = prompts[0], prompts[1]
    code = first.split("```python\n")[1].split("```")[0]
    assert code in second and "def " in code
    assert first.endswith(AGENT_EDITS[0]) and second.endswith(AGENT_EDITS[1]) and AGENT_EDITS[0] in second
    assert prompts[2].split("```python\n")[1] != first.split("```python\n")[1]  # the next file
