"""The bundled SmolLM2-135M-Instruct (Q4_1 GGUF), and the same model requantized by llama.cpp to Q4_K_M, against
HF transformers loading the same file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, SamplingParams
from leapdecode.engine.model_runner import ForwardItem
from leapdecode.engine.sequence import Sequence
from leapdecode.kernels import extension
from leapdecode.models.loader import bundled_model_path

pytestmark = pytest.mark.slow

# the bundled model requantized by llama.cpp's own quantizer (Q5_0, Q8_0, Q4_K, Q6_K and F32 tensors)
SHARED_Q4_K_M = Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / "smollm2-135m-instruct.q4_k_m.gguf"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a helpful math tutor."},
        {"role": "user", "content": "Explain why 7 is a prime number."},
    ],
    [{"role": "user", "content": "List three uses of a paperclip."}],
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def hf_bundled() -> torch.nn.Module:
    return hf_from_gguf(bundled_model_path())


def hf_from_gguf(path: Path) -> torch.nn.Module:
    """HF transformers' own reading of a GGUF file (config mapping, dequantisation, Q/K layout)."""
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    # from_pretrained(gguf_file=...) insists on accelerate; the same loading steps without it:
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)  # its buffers were built on "meta"
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.eval()


@pytest.fixture(scope="module")
def chat_ids(bundled_llm: LLM) -> list[list[int]]:
    return [bundled_llm.apply_chat_template(c) for c in CONVERSATIONS]


def _hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=n,
            pad_token_id=hf.config.eos_token_id if hf.config.pad_token_id is None else None,
        )
    return out[0, len(ids) :].tolist()


def test_bundled_config(bundled_llm: LLM) -> None:
    cfg = bundled_llm.engine.model_config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152


def test_decoding_reads_the_checkpoints_own_blocks(bundled_llm: LLM) -> None:
    """Every projection computes from the GGUF's Q4_1 blocks and the tied LM head from the Q8_0 embedding, with no
    float32 copy of either (layers/block_formats.py); the HF comparisons below check the loader's fusing and Q/K
    row order of the blocks."""
    from leapdecode.layers import small_gemm

    if extension.load_kernel() is None:
        pytest.skip("no C++ toolchain to build the kernel")
    model = bundled_llm.engine.model
    assert small_gemm.packed_formats(model) == {"q4h": 4 * 30, "q8": 1}
    assert all(p.numel() < 600 for p in model.parameters())  # only norms are float parameters


@pytest.mark.skipif(not SHARED_Q4_K_M.is_file(), reason=f"{SHARED_Q4_K_M} is not there")
def test_llama_cpp_q4_k_m_file_matches_hf() -> None:
    """The file users would make with llama.cpp's default preset: its K-quant, Q5_0 and Q8_0 tensors computed from
    their blocks give HF transformers' greedy tokens."""
    from leapdecode.layers import small_gemm

    llm = LLM(model=str(SHARED_Q4_K_M), kv_cache_blocks=256)
    formats = small_gemm.packed_formats(llm.engine.model)
    if extension.load_kernel() is not None:
        assert set(formats) == {"q8", "q4k", "q6k"} and sum(formats.values()) == 4 * 30 + 1, formats
    hf = hf_from_gguf(SHARED_Q4_K_M)
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for conv in CONVERSATIONS[:2]:
        ids = llm.apply_chat_template(conv)
        ours = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert ours == _hf_greedy(hf, ids, 32), conv


def test_greedy_tokens_match_hf(
    bundled_llm: LLM, hf_bundled: torch.nn.Module, chat_ids: list[list[int]]
) -> None:
    """All conversations batched in our engine vs HF ``generate(do_sample=False)`` one at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = bundled_llm.generate([{"prompt_token_ids": ids} for ids in chat_ids], params, use_tqdm=False)
    for conv, ids, out in zip(CONVERSATIONS, chat_ids, outs, strict=True):
        ours = out.outputs[0].token_ids
        ref = _hf_greedy(hf_bundled, ids, MAX_TOKENS)
        assert ours == ref, f"{conv[-1]['content']!r}: first difference at token " + str(
            next(
                (i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b),
                min(len(ours), len(ref)),
            )
        )
        assert len(ours) >= 4 and out.outputs[0].text.strip()
    bm = bundled_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def test_logits_close_to_hf(bundled_llm: LLM, hf_bundled: torch.nn.Module, chat_ids: list[list[int]]) -> None:
    engine = bundled_llm.engine
    ids = chat_ids[2]
    with torch.no_grad():
        ref = hf_bundled(torch.tensor([ids])).logits[0].float()
    seq = Sequence("parity", ids, SamplingParams())
    engine.block_manager.allocate(seq, len(ids))
    try:
        # prefill all but the last 3 tokens, then three single-token decode steps
        n = len(ids) - 3
        rows = [engine.runner.execute([ForwardItem(seq.block_table, 0, ids[:n], list(range(n)))])[0].logits]
        for p in range(n, len(ids)):
            rows.append(engine.runner.execute([ForwardItem(seq.block_table, p, [ids[p]], [0])])[0].logits)
    finally:
        engine.block_manager.free(seq)
    ours = torch.cat(rows)
    diff = (ours - ref).abs().max().item()
    print(f"bundled model: max |logit diff| vs HF {diff:.3g} over {len(ids)} positions")
    assert diff < 5e-4, f"max |logit diff| {diff:.3g} vs HF"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_shipped_eagle_draft_is_lossless_and_accepted_on_the_bundled_model(bundled_llm: LLM) -> None:
    """The shipped feature-conditioned draft runs without arguments, is offered by ``auto``, drafts tokens the
    bundled model accepts, and leaves greedy output unchanged."""
    from leapdecode.speculative.methods.eagle import EagleProposer

    params = SamplingParams(temperature=0, max_tokens=48)
    want = [o.outputs[0].token_ids for o in bundled_llm.chat(CONVERSATIONS, params, use_tqdm=False)]
    spec = LLM.from_engine_of(bundled_llm, speculative_config={"method": "eagle", "num_speculative_tokens": 3,
                                                               "use_cost_model": False})
    assert isinstance(spec.engine.speculator.proposer, EagleProposer)
    outs = spec.chat(CONVERSATIONS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafted > 0 and accepted / drafted > 0.2, (accepted, drafted)
    assert spec.engine.speculator.proposer.num_fallback_tokens == 0
    from leapdecode.speculative.registry import auto_methods

    assert "eagle" in auto_methods(spec.engine.config.speculative_config, spec.engine.model)
