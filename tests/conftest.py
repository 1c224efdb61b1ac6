"""Shared fixtures: tiny random Llama models (HF transformers is the reference) and the bundled model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# One thread by default: the tiny test models gain nothing from more, and on a busy machine (CI runners,
# shared dev boxes) OpenMP threads that wait for each other make every small op ~100x slower. Override with
# LEAPDECODE_TEST_THREADS=N (e.g. for the slow bundled-model tests on an idle machine). `make test` runs two
# pytest-xdist workers, so the suite still uses two cores.
torch.set_num_threads(max(1, min(int(os.environ.get("LEAPDECODE_TEST_THREADS", "1")), os.cpu_count() or 1)))

# No GPU: the Triton kernels (layers/triton_attention.py) run through Triton's interpreter, which must be chosen
# before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_DEFAULTS = dict(
    vocab_size=49152,  # the bundled tokenizer's vocabulary, so tiny models speak real text
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The bundled model's tokenizer (with chat template), saved as HF files once per session;
    ``$LEAPDECODE_TOKENIZER_DIR`` instead where the model is not installed (scripts/gpu_check.sh on a GPU machine)."""
    from leapdecode.models.loader import bundled_model_path
    from leapdecode.models.tokenizer import load_tokenizer

    if os.environ.get("LEAPDECODE_TOKENIZER_DIR"):
        return Path(os.environ["LEAPDECODE_TOKENIZER_DIR"])
    d = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(bundled_model_path()).save_pretrained(str(d))
    return d


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, tokenizer_dir):
    """``make_tiny_model(seed=0, **config_overrides) -> Path`` of an HF folder (safetensors + tokenizer)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    cache: dict = {}

    def make(seed: int = 0, **overrides) -> Path:
        key = (seed, repr(sorted(overrides.items())))
        if key in cache:
            return cache[key]
        cfg = LlamaConfig(**{**TINY_DEFAULTS, **overrides})
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():  # random init is tiny; widen it so logits are not near-uniform
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(4.0)
        d = tmp_path_factory.mktemp("tiny")
        model.save_pretrained(str(d), safe_serialization=True)
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        cache[key] = d
        return d

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_model) -> Path:
    return make_tiny_model()


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_dir):
    """HF transformers' model of the tiny checkpoint (float32, eval): the reference the engine's logits are held to;
    only ever read, so one serves the whole session."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture
def tiny_llm(tiny_model_dir):
    from leapdecode import LLM

    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128, max_num_seqs=16)
    yield llm
    assert_no_leaks(llm)


@pytest.fixture(scope="session")
def bundled_llm():
    from leapdecode import LLM

    return LLM(kv_cache_blocks=1024)


# prompts whose continuations repeat what came before (copies, counting, cycles), so drafters have something to
# find; shared by the speculative, Medusa and blockwise tests
SPEC_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "Summarize: Paris is the capital of France. Paris is known for the Eiffel Tower.",
    "a b c a b c a b",
]


@pytest.fixture(scope="module")
def tiny4(make_tiny_model) -> Path:
    """The 4-layer tiny model the drafter tests share (self_spec, hybrid, feature draft)."""
    return make_tiny_model(num_hidden_layers=4)


@pytest.fixture(scope="module")
def plain4(tiny4):
    """Plain decoding on ``tiny4``, one engine per test module (drafter engines share its weights)."""
    from leapdecode import LLM

    return LLM(model=str(tiny4), kv_cache_blocks=256)


def distill_tiny(model_dir: Path, folder: Path, topics: list[str]) -> Path:
    """``leapdecode train distill-data`` on a tiny model: greedy answers (32 tokens) to "Tell me about <topic>."
    prompts, written to ``folder``/distill; returns that folder."""
    import json

    from leapdecode.cli import main

    prompts = folder / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"x{i}", "prompt": f"Tell me about {t}."})
                                 for i, t in enumerate(topics)))
    data = folder / "distill"
    assert main(["train", "distill-data", "--model", str(model_dir), "--prompts", str(prompts), "--out", str(data),
                 "--max-tokens", "32", "--batch-size", "8"]) == 0
    return data


def layer_row_counters(model) -> tuple[list[int], list]:
    """Rows through each target layer, counted by forward pre-hooks (independent of the drafters' own counters);
    remove the returned handles when done."""
    counts = [0] * len(model.layers)
    handles = []
    for i, layer in enumerate(model.layers):
        def hook(_mod, inputs, i=i):
            counts[i] += inputs[0].shape[0]
        handles.append(layer.register_forward_pre_hook(hook))
    return counts, handles


def assert_no_leaks(llm) -> None:
    """Every KV block is back in the free pool (cached-but-free blocks count as free)."""
    bm = llm.engine.block_manager
    assert not llm.engine.scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)


def assert_same_distribution(plain, spec, n: int = 300) -> None:
    """Two-sample chi-square: the last of 4 sampled tokens (temperature 1, top-k 8) over ``n`` seeds from ``plain``
    (an LLM decoding plainly) and ``spec`` (one speculating, with other seeds) follow one distribution, in a context
    that holds what the model tends to sample, so prompt lookup and drafts find matches. Drafts must be accepted."""
    from leapdecode import SamplingParams

    def tokens(llm, prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    base = plain.get_tokenizer().encode("a b c a b c a b")
    warm = tokens(plain, ["a b c a b c a b"] * 24,
                  [SamplingParams(temperature=1.0, top_k=8, max_tokens=6, seed=i, ignore_eos=True) for i in range(24)])
    prompt = {"prompt_token_ids": [t for w in warm for t in w] + base}
    params = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=1000 + i, ignore_eos=True) for i in range(n)]
    first = [t[-1] for t in tokens(plain, [prompt] * n, params)]
    params2 = [SamplingParams(temperature=1.0, top_k=8, max_tokens=4, seed=5000 + i, ignore_eos=True) for i in range(n)]
    outs = spec.generate([prompt] * n, params2, use_tqdm=False)
    second = [o.outputs[0].token_ids[-1] for o in outs]
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0
    from scipy.stats import chi2_contingency

    vocab = sorted(set(first) | set(second))
    table = [[first.count(v) for v in vocab], [second.count(v) for v in vocab]]
    # merge rare categories so expected counts are large enough for the test
    keep = [i for i in range(len(vocab)) if table[0][i] + table[1][i] >= 10]
    rare = [i for i in range(len(vocab)) if i not in keep]
    rows = [[r[i] for i in keep] + [sum(r[i] for i in rare)] for r in table]
    rows = [[c for c, tot in zip(r, map(sum, zip(*rows))) if tot > 0] for r in rows]
    assert chi2_contingency(rows).pvalue > 1e-3, rows
    assert_no_leaks(spec)


def save_random_heads(folder: Path, offsets, seed: int, first_head_seed: int) -> Path:
    """Untrained heads for the tiny models, with large random weights so their candidates are arbitrary tokens,
    saved as a heads artifact in ``folder`` (shared by the Medusa and blockwise tests)."""
    from leapdecode.speculative.artifacts import save_heads
    from leapdecode.speculative.heads import MedusaHeads

    heads = MedusaHeads(TINY_DEFAULTS["hidden_size"], offsets)
    heads.init_weights(seed=seed, std=0.5)
    with torch.no_grad():
        heads.weight[0].normal_(0, 0.5, generator=torch.Generator().manual_seed(first_head_seed))
    save_heads(folder, heads, None, {"vocab_size": TINY_DEFAULTS["vocab_size"]})
    return folder


def save_random_block_heads(folder: Path, k: int, seed: int) -> Path:
    """Untrained block heads (blockwise decoding) for the tiny models, with large random weights so their
    proposals are arbitrary tokens, saved as a block-heads artifact in ``folder``."""
    from leapdecode.speculative.artifacts import save_block_heads
    from leapdecode.speculative.block_heads import BlockHeads

    heads = BlockHeads(TINY_DEFAULTS["hidden_size"], k, num_blocks=2, attn_heads=2, head_dim=16)
    heads.init_weights(seed=seed, std=0.5)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for prm in (heads.weight, heads.wo):
            prm.normal_(0, 0.5, generator=g)
    save_block_heads(folder, heads, None, {"vocab_size": TINY_DEFAULTS["vocab_size"]})
    return folder
