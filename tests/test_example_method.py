"""Adding a speculative method touches one file: the example method of ``tests/example_methods/repeat.py`` (its
options, proposer and descriptor) runs through ``LLM(...)`` once its folder is on the methods package's path,
with no other file naming it: the option parser, ``bench`` and the registry take it from its descriptor."""

from __future__ import annotations

from pathlib import Path

import pytest

from leapdecode import LLM, SamplingParams
from leapdecode.speculative import methods as methods_package
from leapdecode.speculative import registry

from .conftest import SPEC_PROMPTS as PROMPTS
from .conftest import assert_no_leaks

EXAMPLES = str(Path(__file__).parent / "example_methods")


@pytest.fixture(scope="module")
def with_example():
    methods_package.__path__.append(EXAMPLES)
    registry.refresh()
    try:
        yield
    finally:
        methods_package.__path__.remove(EXAMPLES)
        registry.refresh()


def test_a_new_method_is_one_file(with_example, tiny_model_dir):
    assert "repeat" in registry.method_names() and "repeat" in registry.bench_configs()
    plain = LLM(model=str(tiny_model_dir), kv_cache_blocks=128)
    spec = LLM.from_engine_of(plain, speculative_config={"method": "repeat", "max_repeat": 3,
                                                         "use_cost_model": False})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    prop = spec.engine.speculator.proposer
    # every request's state was freed when it finished; the verification results it observed held the
    # target's logits at every verified row (drafts + 1) and the committed tokens
    assert not prop.stats and len(prop.released) == len(PROMPTS)
    assert prop.verified and all(rows == drafts + 1 and 1 <= done <= drafts + 1 for rows, drafts, done in prop.verified)
    assert_no_leaks(spec)


def test_a_new_method_refuses_the_keys_it_does_not_read(with_example):
    with pytest.raises(ValueError, match="unknown speculative option 'prompt_lookup_max' for method 'repeat'"):
        registry.parse_config({"method": "repeat", "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="max_repeat must be an integer >= 1"):
        registry.parse_config({"method": "repeat", "max_repeat": 0})
    with pytest.raises(ValueError, match="unknown speculative option 'max_repeat' for method 'ngram'"):
        registry.parse_config({"method": "ngram", "max_repeat": 2})
