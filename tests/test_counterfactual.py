"""The drafts a step did not verify are scored against what the target then commits (speculative/counterfactual.py):
the greedy walk that decides a held draft, and a drafter whose estimate sank getting back to drafting because its
unverified drafts kept matching."""

from __future__ import annotations

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.config import SpeculativeConfig
from leapdecode.speculative.counterfactual import MAX_PENDING, PendingDraft, accepted_nodes, decided, hold
from leapdecode.speculative.policy import TREE_REALISM_PRIOR, StepCostModel
from leapdecode.speculative.proposer import Proposal, Proposer
from leapdecode.speculative.speculator import Speculator

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks


def test_a_chain_is_decided_at_its_first_miss_or_its_end():
    chain = PendingDraft("ngram", 10, (5, 6, 7), None)
    assert accepted_nodes(chain, []) is None
    assert accepted_nodes(chain, [5]) is None  # matched so far: the next committed token decides
    assert accepted_nodes(chain, [5, 9]) == 1
    assert accepted_nodes(chain, [4]) == 0
    assert accepted_nodes(chain, [5, 6, 7]) == 3
    assert accepted_nodes(chain, [5, 6, 7, 8]) == 3


def test_a_tree_is_walked_along_the_committed_tokens():
    # root -> 1 (children 3, 4), root -> 2 (child 5); node 3 -> 6
    tree = PendingDraft("suffix", 0, (1, 2, 3, 4, 5, 6), (-1, -1, 0, 0, 1, 2), promise=1.5)
    assert accepted_nodes(tree, [7]) == 0  # no child of the root holds it
    assert accepted_nodes(tree, [2]) is None  # node 2 has a child: not decided yet
    assert accepted_nodes(tree, [2, 5]) == 2  # a leaf
    assert accepted_nodes(tree, [2, 9]) == 1
    assert accepted_nodes(tree, [1, 4]) == 2
    assert accepted_nodes(tree, [1, 3]) is None
    assert accepted_nodes(tree, [1, 3, 6, 0]) == 3
    assert accepted_nodes(tree, [1, 3, 0]) == 2


def test_decided_drafts_leave_the_held_list_and_the_oldest_go_past_the_cap():
    pending: list[PendingDraft] = []
    hold(pending, PendingDraft("a", 2, (3, 4), None))  # continues token_ids[:2]
    hold(pending, PendingDraft("b", 2, (3, 9), None))
    hold(pending, PendingDraft("c", 3, (4, 5), None))
    assert decided(pending, [0, 1, 3]) == []  # nothing decided by one token that matches all three roots' next
    got = decided(pending, [0, 1, 3, 4])
    assert [(d.method, n) for d, n in got] == [("a", 2), ("b", 1)]
    assert [d.method for d in pending] == ["c"]
    for i in range(MAX_PENDING + 5):
        hold(pending, PendingDraft("x", i, (1,), None))
    assert len(pending) == MAX_PENDING and pending[0].start == 5


class SunkTrees(Proposer):
    """Trees of the target's next ``size`` tokens (all accepted if verified), promising one accepted node: a good
    drafter whose realism the test sinks first."""

    name = "sunk"

    def __init__(self, futures: dict[tuple[int, ...], list[int]], size: int = 4) -> None:
        self.futures, self.size = futures, size

    def tree_budget(self, seq, room, cost, batch):
        return min(self.size, room), 2.0

    def _tree(self, seq, k):
        fut = self.futures[tuple(seq.prompt_token_ids)][seq.num_output_tokens:][:k]
        return Proposal(fut, None, list(range(-1, len(fut) - 1))) if fut else Proposal([])

    def propose(self, seqs, budgets):
        return [self._tree(seq, k) for seq, k in zip(seqs, budgets)]

    def peek(self, seq, budget):
        return self._tree(seq, budget)


@pytest.mark.parametrize("peeks", [True, False])
def test_a_drafter_whose_estimate_sank_drafts_again_when_its_unverified_trees_match(tiny_model_dir, peeks):
    """Rows that cost something (a hand-set curve) and a tree drafter whose realism was sunk (as after a run of
    over-promised trees): its trees now hold the target's continuation, but scaled by that realism they promise
    too little to be verified. Scoring the trees it would have drafted against the committed tokens restores its
    realism and it drafts again; a drafter that cannot peek only fades back (0.03% a step) and stays out. The
    tokens are plain decoding's either way."""
    plain = LLM(model=str(tiny_model_dir), kv_cache_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = plain.generate(PROMPTS, params, use_tqdm=False)
    futures = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in base}
    spec = LLM.from_engine_of(plain, speculative_config={"method": "ngram", "use_cost_model": False})
    eng = spec.engine
    trees = SunkTrees(futures)
    if not peeks:
        trees.peek = lambda seq, budget: None
    eng.speculator = sp = Speculator(eng.drafting_view(), SpeculativeConfig(method="ngram", use_cost_model=False),
                                     trees)
    sp.cost = StepCostModel([(1, 1.0), (5, 1.5), (65, 3.0)])  # four extra rows: half a step
    sp.realism.sums["ngram"] = [0.1, TREE_REALISM_PRIOR]  # delivered 1% of its promises so far
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    drafts = sum(o.metrics.num_drafts for o in outs)
    if peeks:
        assert drafts > 0 and sp.realism.ratio("ngram") > 1.0, (drafts, sp.realism.sums)
        assert sum(o.metrics.mean_accepted_tokens for o in outs) / len(outs) > 1.5
    else:
        assert drafts == 0 and sp.realism.ratio("ngram") < 0.1
    assert not sp.states  # every request's held drafts went with it
    assert_no_leaks(spec)
