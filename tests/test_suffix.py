"""Suffix drafting (speculative/methods/suffix.py): the suffix trie, the bounded global cache, losslessness."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.engine.sequence import Sequence
from leapdecode.kernels import extension
from leapdecode.speculative.methods.suffix import (
    GlobalSuffixCache,
    NativeRequestTrie,
    NativeSuffixTrie,
    RequestTrie,
    SuffixOptions,
    SuffixProposer,
    SuffixTrie,
)
from leapdecode.speculative.policy import StepCostModel
from leapdecode.speculative.registry import parse_config
from leapdecode.speculative.tree import depths_of

from .conftest import SPEC_PROMPTS, assert_no_leaks, assert_same_distribution


def _substring_counts(texts: list[list[int]], depth: int) -> Counter:
    out: Counter = Counter()
    for t in texts:
        for i in range(len(t)):
            for j in range(i + 1, min(len(t), i + depth) + 1):
                out[tuple(t[i:j])] += 1
    return out


def _trie_counts(trie: SuffixTrie) -> Counter:
    out: Counter = Counter()
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for t, c in (node.children or {}).items():
            out[(*path, t)] = c.count
            stack.append(((*path, t), c))
    return out


def test_trie_counts_every_substring_and_removal_takes_them_back():
    texts = [[1, 2, 3, 1, 2, 4], [2, 3, 1, 2, 3], [5, 5, 5, 5]]
    trie = SuffixTrie(max_depth=3)
    for t in texts:
        trie.add(t)
    assert _trie_counts(trie) == _substring_counts(texts, 3)
    assert trie.num_nodes == len(_substring_counts(texts, 3))
    trie.remove(texts[0])
    assert _trie_counts(trie) == _substring_counts(texts[1:], 3)
    assert trie.num_nodes == len(_substring_counts(texts[1:], 3))
    # incremental extension (the per-request trie) builds the same counts
    inc = SuffixTrie(max_depth=3)
    active: list = []
    for t in texts[1]:
        active = inc.extend(active, t)
    assert _trie_counts(inc) == _substring_counts([texts[1]], 3)


def test_match_and_frequency_scored_tree():
    trie = SuffixTrie(max_depth=8)
    trie.add([7, 1, 2, 3, 9, 1, 2, 3, 9, 1, 2, 4, 1, 2])
    node, length = trie.match([5, 9, 1, 2], max_match=6)
    assert length == 3  # "9 1 2" occurred twice with a continuation (-> 3, -> 4); "5 9 1 2" never
    nodes = trie.draft(node, max_nodes=10, min_prob=0.1, max_depth=4)
    assert nodes[0].score == pytest.approx(0.5) and nodes[1].score == pytest.approx(0.5)
    # "1 2" is followed by 3 twice, by 4 once (and once by the text's end): 3 first
    short, n = trie.match([1, 2], max_match=6)
    assert n == 2 and trie.draft(short, 4, 0.1, 4)[0].token == 3
    assert trie.draft(short, 4, 0.1, 4)[0].score == pytest.approx(2 / 3)
    assert {n.token for n in nodes if n.parent == -1} == {3, 4}
    depths_of([n.parent for n in nodes])  # parents first
    assert all(n.score <= (nodes[n.parent].score if n.parent >= 0 else 1.0) for n in nodes)
    assert trie.match([8, 8], 4) == (None, 0)


def _needs_kernels() -> None:
    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")


def test_the_native_request_trie_is_the_python_trie_node_for_node():
    """kernels/suffix_index.cpp against RequestTrie: the same node count, the same longest match for every context,
    the same best-first tree (tokens, parents, scores to the bit) from it, text appended in uneven pieces."""
    _needs_kernels()
    rng = random.Random(5)
    phrases = [[rng.randrange(40) for _ in range(rng.randrange(2, 9))] for _ in range(12)]
    text: list[int] = []
    while len(text) < 1500:
        text += rng.choice(phrases) if rng.random() < 0.7 else [rng.randrange(300)]
    for depth in (4, 24):
        py, native = RequestTrie(depth), NativeRequestTrie(depth)
        done = 0
        while done < len(text):  # a prompt-sized first piece (the trie sizes itself for it), then a few at a time
            piece = text[done : done + (300 if done == 0 else rng.randrange(1, 60))]
            py.append(piece)
            native.append(piece)
            done += len(piece)
            assert native.num_nodes == py.num_nodes
            for max_match in (1, 3, 16):
                ctx = text[max(0, done - 20) : done]
                (pn, plen), (nn, nlen) = py.match(ctx, max_match), native.match(ctx, max_match)
                assert plen == nlen and (pn is None) == (nn is None)
                if pn is not None:
                    for limit, min_prob in ((1, 0.0), (32, 0.0), (16, 0.1)):
                        want = py.draft_nodes(pn, limit, min_prob, depth - plen)[0]
                        assert native.draft_nodes(nn, limit, min_prob, depth - plen)[0] == want
    assert native.memory_bytes() < py.memory_bytes() / 3  # allocated (its arrays last doubled) against ~260 B a node


def _same_tries(py: SuffixTrie, native: NativeSuffixTrie, contexts: list[list[int]], depth: int,
                py_key: dict | None = None, native_key: dict | None = None) -> None:
    """The same node count, longest matches, best-first trees and node owners (compared as the requests they
    name where the two tries numbered the same texts differently)."""
    assert native.num_nodes == py.num_nodes
    for ctx in contexts:
        for max_match in (1, 3, 8):
            (pn, plen), (nn, nlen) = py.match(ctx, max_match), native.match(ctx, max_match)
            assert plen == nlen and (pn is None) == (nn is None)
            if pn is not None:
                for limit, min_prob in ((1, 0.0), (32, 0.0), (16, 0.1)):
                    want, pw = py.draft_nodes(pn, limit, min_prob, depth - plen)
                    got, nw = native.draft_nodes(nn, limit, min_prob, depth - plen)
                    assert got == want
                    owners = [native.owner_of(n) for n in nw], [py.owner_of(n) for n in pw]
                    if py_key is not None and native_key is not None:
                        owners = [native_key[o] for o in owners[0]], [py_key[o] for o in owners[1]]
                    assert owners[0] == owners[1]


def test_the_native_global_trie_is_the_python_trie_node_for_node_through_removals():
    """kernels/suffix_index.cpp's add / remove against SuffixTrie: texts with shared phrases join and leave in a
    random order (nodes freed and their ids reused, children deleted and created again, which a dict keeps in
    insertion order), and every count, match, tree and owner stays the same."""
    _needs_kernels()
    rng = random.Random(11)
    phrases = [[rng.randrange(30) for _ in range(rng.randrange(2, 7))] for _ in range(10)]
    texts = []
    for _ in range(40):
        t: list[int] = []
        while len(t) < rng.randrange(5, 80):
            t += rng.choice(phrases) if rng.random() < 0.6 else [rng.randrange(200)]
        texts.append(t)
    probes = [t[i : i + 10] for t in texts[:12] for i in (0, 5)] + phrases
    for depth in (3, 12):
        py, native = SuffixTrie(depth), NativeSuffixTrie(depth)
        kept: list[int] = []
        for serial, t in enumerate(texts, start=1):
            py.add(t, serial)
            native.add(t, serial)
            kept.append(serial - 1)
            if rng.random() < 0.4:
                gone = kept.pop(rng.randrange(len(kept)))
                py.remove(texts[gone])
                native.remove(texts[gone])
            _same_tries(py, native, probes, depth)
        for gone in kept:
            py.remove(texts[gone])
            native.remove(texts[gone])
        assert native.num_nodes == py.num_nodes == 0 and native.match(texts[0], 4) == (None, 0)
    with pytest.raises(RuntimeError, match="not added"):
        native.remove([1, 2, 3])


def test_the_native_global_cache_cap_holds_after_1000_requests(tmp_path):
    """The C++ trie under the same 1,000 requests: its bytes stay under the cap by dropping the oldest requests,
    are a fraction of Python's for the same texts, after all the evictions it holds exactly the kept texts, and a
    saved cache loads back as the same trie."""
    _needs_kernels()
    cap_mb = 1.0
    cache = GlobalSuffixCache(max_depth=12, cap_mb=cap_mb, path=str(tmp_path / "suffix.pt"))
    assert isinstance(cache.trie, NativeSuffixTrie)
    for r in range(1000):
        cache.add(f"req-{r}", [(r * 37 + i * 11) % 5000 for i in range(40)] + [1, 2, 3, 4, 5] * 4)
        assert cache.live_bytes() <= cap_mb * 2**20
        assert cache.memory_bytes() <= 2 * cap_mb * 2**20  # allocated: the high-water mark of live + one text
    assert cache.num_evicted > 0 and len(cache.texts) < 1000
    py = GlobalSuffixCache(max_depth=12, cap_mb=64, native=False)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for key, text in cache.texts.items():
        py.add(key, text.tolist())
    py_held = tracemalloc.get_traced_memory()[0] - base  # what the same texts really hold as Python objects
    tracemalloc.stop()
    _same_tries(py.trie, cache.trie, [t.tolist()[:10] for t in list(cache.texts.values())[:5]], 12, py.keys,
                cache.keys)
    assert cache.trie.memory_bytes() < py_held / 2.5  # allocated (high-water) against what Python held
    cache.save()
    again = GlobalSuffixCache(max_depth=12, cap_mb=cap_mb, path=str(tmp_path / "suffix.pt"))
    assert list(again.texts) == list(cache.texts)
    _same_tries(py.trie, again.trie, [t.tolist()[:10] for t in list(cache.texts.values())[:5]], 12, py.keys,
                again.keys)


def test_global_cache_cap_holds_and_memory_after_1000_requests(tmp_path):
    """1,000 requests of 60 tokens each (a few shared phrases, the rest their own), the Python trie: the estimate
    of the trie's bytes stays under the cap by dropping the oldest requests, and it is not below what Python
    really holds."""
    cap_mb = 2.0
    cache = GlobalSuffixCache(max_depth=12, cap_mb=cap_mb, path=str(tmp_path / "suffix.pt"), native=False)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for r in range(1000):
        text = [(r * 37 + i * 11) % 5000 for i in range(40)] + [1, 2, 3, 4, 5] * 4
        cache.add(f"req-{r}", text)
        assert cache.memory_bytes() <= cap_mb * 2**20
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert cache.num_evicted > 0 and len(cache.texts) < 1000
    # the estimate is what Python really holds, within a margin
    assert 0.75 * held <= cache.memory_bytes() <= 1.5 * held, (cache.trie.num_nodes, cache.memory_bytes(), held)
    cache.save()
    again = GlobalSuffixCache(max_depth=12, cap_mb=cap_mb, path=str(tmp_path / "suffix.pt"), native=False)
    assert _trie_counts(again.trie) == _trie_counts(cache.trie)


@pytest.mark.parametrize("native", [False, True])
def test_global_cache_evicts_the_least_recently_used_request(native):
    """Under the cap, the request whose text last drafted an accepted token stays; an untouched newer one leaves."""
    if native:
        _needs_kernels()
    texts = {k: [base + i for i in range(30)] for k, base in (("a", 0), ("b", 100), ("c", 200), ("d", 300))}
    probe = GlobalSuffixCache(max_depth=6, cap_mb=64, native=native)
    for k in "abc":
        probe.add(k, texts[k])
    cap_mb = (probe.live_bytes() + 1) / 2**20  # room for three texts, not four
    for touched, gone in (("a", "b"), (None, "a")):
        cache = GlobalSuffixCache(max_depth=6, cap_mb=cap_mb, native=native)
        for k in "abc":
            cache.add(k, texts[k])
        if touched is not None:
            node, length = cache.trie.match(texts[touched][:4], max_match=4)
            _, where = cache.trie.draft_nodes(node, 2, 0.0, 3)
            cache.touch(where[-1])  # as after an accepted draft through a's text
            assert cache.num_touched == 1
        cache.add("d", texts["d"])
        assert gone not in cache.texts and set(cache.texts) == {"a", "b", "c", "d"} - {gone}
        assert cache.live_bytes() <= cache.cap_bytes
    if not native:  # a's text has left that cache: nothing moves (a freed C++ node's id may name a newer text)
        node, _ = cache.trie.match(texts["b"][:4], max_match=4)
        _, where = cache.trie.draft_nodes(node, 2, 0.0, 3)
        cache._drop("b")
        cache.touch(where[-1])
        assert cache.num_touched == 0


def test_options_are_typed_and_unknown_keys_refused():
    cfg = parse_config({"method": "suffix", "global_tree": False, "max_spec_factor": 1.5})
    opts = cfg.options(SuffixOptions)
    assert not opts.global_tree and opts.max_spec_factor == 1.5
    with pytest.raises(ValueError, match="global_cache_mb"):
        parse_config({"method": "suffix", "global_cache_mb": 0})
    with pytest.raises(ValueError, match="unknown speculative option 'top_k'"):
        parse_config({"method": "suffix", "top_k": 3})


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), kv_cache_blocks=512, max_num_seqs=16)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_suffix_is_token_identical_and_the_global_tree_helps_a_repeat(plain):
    spec = LLM.from_engine_of(plain, speculative_config={"method": "suffix", "use_cost_model": False},
                              block_size=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             repetition_penalty=1.3 if i == 2 else 1.0) for i in range(len(SPEC_PROMPTS))]
    want = _ids(plain.generate(SPEC_PROMPTS, params, use_tqdm=False))
    first = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert _ids(first) == want
    again = spec.generate(SPEC_PROMPTS, params, use_tqdm=False)  # the same requests: their outputs are indexed
    assert _ids(again) == want
    assert sum(o.metrics.num_accepted_tokens for o in again) > sum(o.metrics.num_accepted_tokens for o in first)
    prop = spec.engine.speculator.proposer
    assert isinstance(prop, SuffixProposer) and len(prop.cache.texts) == 2 * len(SPEC_PROMPTS)
    assert not prop._requests  # per-request tries freed
    prop.forget_requests()  # what the benchmark does between its rounds over the same prompts
    assert not prop.cache.texts and prop.cache.num_tokens == 0 and prop.cache.trie.live_bytes() < 4096
    assert _ids(spec.generate(SPEC_PROMPTS, params, use_tqdm=False)) == want
    assert len(prop.cache.texts) == len(SPEC_PROMPTS)
    assert_no_leaks(spec)
    private = LLM.from_engine_of(plain, speculative_config={"method": "suffix", "use_cost_model": False,
                                                            "global_tree": False})
    private.generate(SPEC_PROMPTS, params, use_tqdm=False)
    assert private.engine.speculator.proposer.cache is None


def test_sampled_suffix_matches_plain_sampling_distribution(plain):
    spec = LLM.from_engine_of(plain, speculative_config={"method": "suffix", "use_cost_model": False})
    prompt = "a b c a b c a b"
    seeded = [SamplingParams(temperature=1.0, top_k=8, max_tokens=12, seed=40 + i, ignore_eos=True)
              for i in range(4)]
    assert _ids(spec.generate([prompt] * 4, seeded, use_tqdm=False)) == \
        _ids(plain.generate([prompt] * 4, seeded, use_tqdm=False))
    assert_same_distribution(plain, spec)


def test_auto_on_a_model_without_artefacts_chooses_among_the_training_free_drafters(plain):
    spec = LLM.from_engine_of(plain, speculative_config={"method": "auto"})
    assert set(spec.engine.speculator.proposers) == {"ngram", "suffix", "recycling"}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _ids(plain.generate(SPEC_PROMPTS, params, use_tqdm=False))
    assert _ids(spec.generate(SPEC_PROMPTS * 2, params, use_tqdm=False)) == want * 2
    assert_no_leaks(spec)


def test_suffix_calibration_drifts_back_while_no_tree_is_sized():
    """A few failed trees shrink suffix's own calibration; while it then sizes no tree (rows too dear for its
    shrunk estimate) the calibration drifts back, so the drafter is not locked out for the engine's life."""
    prop = SuffixProposer(SuffixOptions(global_tree=False))
    seq = Sequence("r", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], SamplingParams(max_tokens=8))
    for _ in range(30):
        prop.calib.record(prop.name, 3.0, 0)
    low = prop.calibration()
    steep = StepCostModel([(1, 1.0), (33, 33.0)])  # every row a whole step: nothing is worth drafting
    for _ in range(200):
        assert prop.tree_budget(seq, 8, steep, 1)[0] == 0
    assert low < prop.calibration() < 1.0
