"""The layer-skip self-draft (speculative/methods/layer_skip.py, skip_search.py) and auto's difficulty-driven compute
path (speculative/difficulty.py): the search's decisions, the router's branch for given signals, losslessness."""

from __future__ import annotations

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.speculative.difficulty import choose_path, narrow, row_signal, update_signal
from leapdecode.speculative.methods.layer_skip import LayerSkipOptions, LayerSkipProposer, kept_runs
from leapdecode.speculative.registry import auto_methods, parse_config
from leapdecode.speculative.skip_search import GRID, SkipSearch, check_skip
from leapdecode.speculative.state import DifficultyState

from .conftest import SPEC_PROMPTS, assert_no_leaks, assert_same_distribution


@pytest.fixture(scope="module")
def deep_plain(make_tiny_model):
    """A 6-layer tiny model: four middle layers to skip."""
    return LLM(model=str(make_tiny_model(num_hidden_layers=6)), kv_cache_blocks=256)


# ------------------------------------------------------------------------------------------------ search
def test_kept_runs_are_the_contiguous_layers_left():
    assert kept_runs(6, (2, 3)) == [range(0, 2), range(4, 6)]
    assert kept_runs(5, (1, 3)) == [range(0, 1), range(2, 3), range(4, 5)]
    assert kept_runs(3, ()) == [range(0, 3)]


def test_fixed_skip_sets_are_checked():
    assert check_skip([3, 1], 6) == (1, 3)
    for bad in ([0], [5], [2, 2], []):
        with pytest.raises(ValueError, match="skip_layers"):
            check_skip(bad, 6)


def test_search_grid_follows_influence_and_refines_toward_the_faster_set():
    s = SkipSearch(num_layers=12, rounds=5)
    # layers 7, 8, 9 barely turn the stream; 0 and 11 always run whatever they measure
    infl = [5.0, 1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.01, 0.02, 0.03, 0.4, 0.0]
    s.record_influence(infl, rows=1)
    grid = s.round_candidates()
    assert len(grid) == len(GRID) and grid[0] == tuple(sorted((7, 8)))  # round(0.2 * 10) least influential
    assert all(0 not in g and 11 not in g for g in grid)
    # agreement falls with skipped layers; a speed that pays for skipping: the middle grid point wins
    agree = {2: 0.9, 4: 0.8, 5: 0.5}
    speed = lambda kept, acc: acc * (2.0 - kept)  # noqa: E731
    s.record_round({g: (int(agree[len(g)] * 100), 100) for g in grid}, speed)
    assert s.best == grid[1] and s.rounds_left == 4
    nxt = s.round_candidates()
    # the best beside one fewer and a swap (one more skipped is the grid's last point, scored already)
    assert nxt == [s.best, (7, 8, 9), (6, 7, 8, 9)]
    # live acceptance moves the choice: the best set drafts poorly, another scored set wins
    s.record_live(s.best, drafted=400, accepted=40)
    s.choose(speed)
    assert s.best != grid[1]


def test_search_stops_when_nothing_pays_and_fixed_sets_never_search():
    s = SkipSearch(num_layers=8, rounds=6)
    s.record_influence([1.0] * 8, rows=1)
    s.record_round({g: (1, 10) for g in s.round_candidates()}, lambda kept, acc: 0.5)
    assert not s.searching and s.best is not None
    fixed = SkipSearch(num_layers=8, rounds=6, fixed=(2, 3))
    assert not fixed.searching and fixed.best == (2, 3) and fixed.acceptance() == 0.5


def test_options_are_typed():
    cfg = parse_config({"method": "layer_skip", "skip_layers": [2, 3], "search_rounds": 2})
    assert cfg.options(LayerSkipOptions).skip_layers == (2, 3)
    with pytest.raises(ValueError, match="search_window"):
        parse_config({"method": "layer_skip", "search_window": 40})
    with pytest.raises(ValueError, match="unknown speculative option 'top_k'"):
        parse_config({"method": "layer_skip", "top_k": 3})
    with pytest.raises(ValueError, match="compute_path"):
        parse_config({"method": "auto", "compute_path": "fast"})
    with pytest.raises(ValueError, match="hard_below <= easy_above"):
        parse_config({"method": "auto", "compute_path": "difficulty", "hard_below": 0.8, "easy_above": 0.5})


# ------------------------------------------------------------------------------------ difficulty router
def _state(margin: float, steps: int = 10) -> DifficultyState:
    return DifficultyState(top1=margin, margin=margin, steps=steps)


@pytest.mark.parametrize("st, task, copying, ready, path", [
    (_state(0.9, steps=1), "chat", False, True, "speculative"),  # warming up
    (_state(0.05), "chat", False, True, "plain"),  # hard
    (_state(0.05), "grounded", False, True, "speculative"),  # hard, but the task works on its input
    (_state(0.05), "chat", True, True, "speculative"),  # copying
    (_state(0.9), "chat", False, True, "self_draft"),  # easy
    (_state(0.9), "chat", False, False, "speculative"),  # easy, no skip set yet
    (_state(0.4), "math", False, True, "speculative"),  # medium
])
def test_compute_path_for_given_signals(st, task, copying, ready, path):
    got, why = choose_path(st, task, copying, ready, easy_above=0.6, hard_below=0.2)
    assert got == path and why


def test_paths_narrow_the_candidates_and_the_signal_averages_rows():
    names = ["ngram", "layer_skip", "suffix"]
    assert narrow("plain", names, {"layer_skip"}) == []
    assert narrow("speculative", names, {"layer_skip"}) == ["ngram", "suffix"]
    assert narrow("self_draft", names, {"layer_skip"}) == ["layer_skip", "ngram", "suffix"]
    sure = torch.full((50,), -20.0)
    sure[3] = 10.0
    top1, margin = row_signal(sure)
    assert top1 > 0.99 and margin > 0.99
    flat = torch.zeros(50)
    assert row_signal(flat)[1] == pytest.approx(0.0, abs=1e-6)
    st = DifficultyState()
    update_signal(st, sure)
    update_signal(st, flat)
    assert st.steps == 2 and 0.5 < st.margin < 0.8  # the running average moved toward the hesitant row


def test_auto_builds_the_self_draft_only_on_the_difficulty_path(deep_plain):
    target = deep_plain.engine.model
    assert "layer_skip" not in auto_methods(parse_config({"method": "auto"}), target)
    assert "layer_skip" in auto_methods(parse_config({"method": "auto", "compute_path": "difficulty"}), target)


# ------------------------------------------------------------------------------------------ lossless
def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("extra", [{"skip_layers": [2, 3]}, {"search_rounds": 3, "search_window": 8}])
def test_greedy_layer_skip_is_token_identical(deep_plain, extra):
    cfg = {"method": "layer_skip", "use_cost_model": False, "num_speculative_tokens": 3, **extra}
    spec = LLM.from_engine_of(deep_plain, speculative_config=cfg, block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(SPEC_PROMPTS))]
    want = _ids(deep_plain.generate(SPEC_PROMPTS, params, use_tqdm=False))
    for _ in range(2):  # the second pass drafts with what the search found in the first
        outs = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
        assert _ids(outs) == want
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, LayerSkipProposer) and prop.num_chains > 0
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    if "search_rounds" in extra:
        assert prop.num_rounds > 0 and prop.search.best is not None
    assert_no_leaks(spec)


def test_sampled_layer_skip_matches_plain_sampling_distribution(deep_plain):
    spec = LLM.from_engine_of(deep_plain, speculative_config={"method": "layer_skip", "skip_layers": [3],
                                                              "use_cost_model": False, "num_speculative_tokens": 2})
    assert_same_distribution(deep_plain, spec)


def test_auto_on_the_difficulty_path_is_lossless_and_explains(deep_plain):
    cfg = {"method": "auto", "compute_path": "difficulty", "easy_above": 0.3, "hard_below": 0.05}
    spec = LLM.from_engine_of(deep_plain, speculative_config=cfg)
    assert "layer_skip" in spec.engine.speculator.proposers
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = _ids(deep_plain.generate(SPEC_PROMPTS, params, use_tqdm=False))
    outs = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == want
    for o in outs:
        m = o.metrics
        assert sum(m.compute_paths.values()) > 0 and set(m.compute_paths) <= {"plain", "speculative", "self_draft"}
        assert "compute path speculative: warming up" in m.route
    assert_no_leaks(spec)


@pytest.mark.slow
def test_bundled_model_layer_skip_is_token_identical(bundled_llm):
    spec = LLM.from_engine_of(bundled_llm, speculative_config={"method": "layer_skip", "use_cost_model": False,
                                                               "num_speculative_tokens": 2, "search_rounds": 2})
    params = SamplingParams(temperature=0, max_tokens=48)
    prompts = [[{"role": "user", "content": p}] for p in SPEC_PROMPTS[:3]]
    want = _ids(bundled_llm.chat(prompts, params, use_tqdm=False))
    outs = spec.chat(prompts, params, use_tqdm=False)
    assert _ids(outs) == want
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
