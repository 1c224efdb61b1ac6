"""The strategy router on the bundled model: a prompt that copies its input and then writes freely (the domain
switch), and the lossy branch running the shipped blockwise heads."""

from __future__ import annotations

from leapdecode import LLM, SamplingParams
from leapdecode.speculative.policy import StepCostModel

from .conftest import assert_no_leaks

# a copy of its input, then free writing (with ignore_eos the bundled model goes on past its answer into new text)
SWITCH_TEXT = ("The committee met on Tuesday to review the budget for the new library, and agreed to fund the reading "
               "room, the children's corner and a small cafe.")
SWITCH_CHAT = [{"role": "user", "content": "Quote this sentence exactly and then continue the story with what "
                                           f"happened next: \"{SWITCH_TEXT}\""}]


def test_domain_switch_from_copying_to_writing_changes_the_drafter_losslessly(bundled_llm):
    params = SamplingParams(temperature=0, max_tokens=72, ignore_eos=True)
    plain = bundled_llm.chat([SWITCH_CHAT], params, use_tqdm=False)[0]
    spec = LLM.from_engine_of(bundled_llm, speculative_config={"method": "auto", "methods": ["ngram"]})
    sp = spec.engine.speculator
    # a step cost that rises 0.3x per verified row (this machine's timing must not decide the test): prompt lookup
    # pays at the copy's acceptance, not at free writing's
    sp.cost = StepCostModel([(1, 1.0), (65, 20.2)])
    steps: list[tuple[int, str | None]] = []
    propose = sp.propose

    def record(snapshot):
        drafts = propose(snapshot)
        steps.extend((slot.seq.num_output_tokens, drafts[slot.seq.request_id].method) for slot in snapshot.slots
                     if slot.seq.request_id in drafts)
        return drafts

    sp.propose = record
    out = spec.chat([SWITCH_CHAT], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # lossless across the switch
    m = out.metrics
    assert m.num_domain_switches >= 1
    switch_at = int(m.route.split("domain switch to writing at output token ")[1].split(";")[0])
    copy_len = len(bundled_llm.engine.tokenizer.encode(SWITCH_TEXT))
    assert copy_len - 5 <= switch_at <= copy_len + 15  # the copy ends, the detector notices within a few tokens
    before = [meth for n, meth in steps if n < switch_at]
    after = [meth for n, meth in steps if n > switch_at]
    assert before.count("ngram") >= 3  # prompt lookup drafted the copy
    assert "ngram" not in after  # and stopped at the switch: free writing decodes plainly here
    assert_no_leaks(spec)



def test_lossy_branch_runs_the_shipped_blockwise_heads(bundled_llm):
    """An extreme latency target on the lossy branch: the shipped heads' whole block kept every step."""
    cfg = {"method": "auto", "methods": ["ngram"], "lossless": False, "latency_slo_ms": 5}
    spec = LLM.from_engine_of(bundled_llm, speculative_config=cfg)
    sp = spec.engine.speculator
    assert set(sp.proposers) == {"ngram", "blockwise"}
    s = sp.proposers["blockwise"].settings
    assert (s.acceptance, s.top_k, s.min_block, s.k) == ("topk", 2, 8, 8)
    out = spec.chat([SWITCH_CHAT], SamplingParams(temperature=0, max_tokens=18, ignore_eos=True), use_tqdm=False)[0]
    m = out.metrics
    assert "lossy allowed -> latency < 10 ms/token: non-autoregressive blocks [blockwise]" in m.route
    # every block kept whole: the prompt's step (1 token), a full block (8 drafts + 1), then the rest (7 + 1)
    assert set(m.draft_methods) == {"blockwise"} and m.num_target_steps == 3 and m.num_output_tokens == 18
    assert_no_leaks(spec)
