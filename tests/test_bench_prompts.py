"""Benchmark prompt sets built from the shared data folder (skipped where it is absent)."""

from __future__ import annotations

import pytest

from leapdecode import LLM
from leapdecode.bench.workload import Run, Workload, load_workload
from leapdecode.eval.prompts import (
    AGENT_EDITS,
    AGENT_LOOP,
    AGENT_SYSTEM,
    agent_sessions,
    load_prompt_set,
    shared_data_dir,
)


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


@pytest.mark.skipif(not (shared_data_dir() / "code" / "humaneval.jsonl").is_file(), reason="no shared data")
def test_agent_sessions_count_requests_and_ask_each_edit_of_the_written_version():
    sessions = agent_sessions(7)
    assert [len(s.turns) for s in sessions] == [3, 3, 1]  # 7 requests: the last session cut short
    first = sessions[0]
    assert first.system == AGENT_SYSTEM and "```python\n" in first.turns[0] and first.turns[0].endswith(AGENT_EDITS[0])
    assert "write_file" in first.turns[1] and first.turns[1].endswith(AGENT_EDITS[1])
    assert "```" not in first.turns[1]  # the version the agent wrote is its own answer, already in the session
    assert sessions[1].turns[0] != first.turns[0]
    with pytest.raises(ValueError, match="leapdecode bench --prompts agent_loop"):
        load_prompt_set(AGENT_LOOP, 3)


@pytest.mark.skipif(not (shared_data_dir() / "code" / "humaneval.jsonl").is_file(), reason="no shared data")
def test_an_agent_loop_request_resends_the_session_with_the_runs_own_answers(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=64, max_num_seqs=4)
    loop = load_workload(llm, AGENT_LOOP, 4, raw=False, max_prompt_tokens=None)
    assert loop.waves == [[0, 3], [1], [2]] and loop.batch == 2 and loop.num_requests == 4
    run, other = Run(), Run()
    with pytest.raises(RuntimeError, match="before the answer"):
        loop.prompt_ids(run, 1)
    p0 = loop.prompt_ids(run, 0)
    assert loop.prompt_ids(other, 0) == p0 == loop.first_prompt()
    loop.record(run, 0, "def f():\n    return 1")
    loop.record(other, 0, "something else")
    p1 = loop.prompt_ids(run, 1)
    tok = llm.get_tokenizer()
    # the earlier request is a prefix (what the prefix cache reuses), then the answer, then the next turn
    assert p1[: len(p0)] == p0 and "return 1" in tok.decode(p1[len(p0):])
    assert p1 != loop.prompt_ids(other, 1)
    loop.record(run, 1, "x " * llm.engine.max_model_len)  # an answer that fills the model's context
    with pytest.raises(ValueError, match="--max-prompt-tokens"):
        loop.prompt_ids(run, 2)
    raw = load_workload(llm, AGENT_LOOP, 2, raw=True, max_prompt_tokens=50)
    raw.record(run, 0, "ok")
    assert len(raw.prompt_ids(run, 1)) == 50 and tok.decode(raw.prompt_ids(run, 1)).endswith("\n\n")


def test_a_prompt_set_is_one_wave_and_sends_the_same_prompts_to_every_run():
    fixed = Workload([[1, 2], [3]])
    assert fixed.waves == [[0, 1]] and fixed.batch == 2 and fixed.prompt_ids(Run(), 1) == [3]
    with pytest.raises(ValueError, match="no requests"):
        Workload([])
