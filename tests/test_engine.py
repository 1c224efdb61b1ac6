"""End-to-end engine behaviour on a tiny random Llama (real tokenizer): batching, chunked prefill, preemption,
prefix caching, stop conditions, sampling parameters, the ``LLM`` API and its errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from leapdecode import LLM, RequestOutput, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,  # ~60 tokens: several prefill chunks at budget 32
    "Hello",
    "Paged attention keeps the KV cache in fixed-size blocks so that memory is not fragmented.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Once upon a time",
    "A",
]


def assert_no_leaks(llm: LLM) -> None:
    """Same check as ``conftest.assert_no_leaks`` (a test module cannot import conftest in every mode)."""
    bm = llm.engine.block_manager
    assert not llm.engine.scheduler.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
    assert all(b.ref_count == 0 for b in bm.blocks)


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def toks(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def make_llm(path: Path, **kw) -> LLM:
    args = dict(model=str(path), kv_cache_blocks=128, max_num_seqs=16)
    return LLM(**{**args, **kw})


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> dict[str, list[list[int]]]:
    """Greedy outputs of every prompt, each run alone in a fresh engine without prefix caching."""
    llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    out = {"solo": [toks(llm.generate(p, greedy(20), use_tqdm=False))[0] for p in PROMPTS]}
    assert_no_leaks(llm)
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------ batching


def test_greedy_matches_hf_generate(tiny_llm, hf_model, reference) -> None:
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[2], add_special_tokens=True)
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=20)
    assert reference["solo"][2] == hf[0, len(ids) :].tolist()


def test_batched_equals_solo_with_chunked_prefill(tiny_model_dir, reference) -> None:
    llm = make_llm(tiny_model_dir, max_num_batched_tokens=32)
    outs = llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert toks(outs) == reference["solo"]
    assert max(len(o.prompt_token_ids) for o in outs) > 32  # the long prompt really was chunked
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert_no_leaks(llm)


def test_batched_equals_solo_in_one_step(tiny_llm, reference) -> None:
    outs = tiny_llm.generate(PROMPTS, greedy(20), use_tqdm=False)
    assert toks(outs) == reference["solo"]


def test_preemption_loses_nothing(tiny_model_dir) -> None:
    prompts = [
        f"Request number {i} asks about {w}" for i, w in enumerate("KV cache blocks are very scarce".split())
    ]
    params = [greedy(24), SamplingParams(temperature=0.9, seed=7, max_tokens=24)] * 3
    roomy = make_llm(tiny_model_dir, block_size=4)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    tight = make_llm(tiny_model_dir, block_size=4, kv_cache_blocks=12, max_num_seqs=6)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.stats.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in got) == tight.engine.stats.num_preemptions
    assert toks(got) == toks(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert all(len(t) == 24 for t in toks(got))
    assert_no_leaks(roomy)
    assert_no_leaks(tight)


# ------------------------------------------------------------------------------------ prefix caching


def test_prefix_cache_hit_gives_identical_output(tiny_llm, tiny_model_dir) -> None:
    shared = "You are a careful assistant. Answer briefly and precisely, citing the numbers given. " * 3
    first, second = shared + "What is 2 + 2?", shared + "Name a colour."
    plain = make_llm(tiny_model_dir, enable_prefix_caching=False)
    expected = toks(plain.generate([second], greedy(12), use_tqdm=False))[0]
    a = tiny_llm.generate(first, greedy(12), use_tqdm=False)[0]
    assert a.metrics.num_cached_prompt_tokens == 0
    b = tiny_llm.generate(second, greedy(12), use_tqdm=False)[0]
    bs = tiny_llm.config.block_size
    pairs = zip(a.prompt_token_ids, b.prompt_token_ids, strict=False)
    common = next(i for i, (x, y) in enumerate(pairs) if x != y)
    assert common >= 3 * bs
    assert b.metrics.num_cached_prompt_tokens == common // bs * bs  # every full block of the shared prefix
    assert b.outputs[0].token_ids == expected
    # the very same prompt again: every full block but the one holding the last prompt token hits
    again = tiny_llm.generate(second, greedy(12), use_tqdm=False)[0]
    assert again.metrics.num_cached_prompt_tokens == (len(b.prompt_token_ids) - 1) // bs * bs
    assert again.outputs[0].token_ids == expected
    assert_no_leaks(plain)


# ------------------------------------------------------------------------------------ stop conditions


def test_max_tokens_finish(tiny_llm) -> None:
    out = tiny_llm.generate("Hello", greedy(5), use_tqdm=False)[0]
    c = out.outputs[0]
    assert (len(c.token_ids), c.finish_reason, c.stop_reason) == (5, "length", None)
    assert out.metrics.num_output_tokens == 5 and out.metrics.num_prompt_tokens == len(out.prompt_token_ids)


def test_max_model_len_finish(tiny_model_dir) -> None:
    llm = make_llm(tiny_model_dir, max_model_len=24)
    out = llm.generate({"prompt_token_ids": list(range(100, 120))}, greedy(50), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    assert_no_leaks(llm)


def test_stop_token_ids(tiny_llm, reference) -> None:
    ref = reference["solo"][4]
    stop_at = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    out = tiny_llm.generate(PROMPTS[4], greedy(20, stop_token_ids=[ref[stop_at]]), use_tqdm=False)[0].outputs[
        0
    ]
    assert out.token_ids == ref[: stop_at + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", ref[stop_at])


def test_stop_string(tiny_llm, reference) -> None:
    tok = tiny_llm.get_tokenizer()
    full = tiny_llm.generate(PROMPTS[3], greedy(20), use_tqdm=False)[0].outputs[0]
    assert full.token_ids == reference["solo"][3]
    piece = tok.decode(full.token_ids[6:7], skip_special_tokens=True).strip()
    assert piece
    out = tiny_llm.generate(PROMPTS[3], greedy(20, stop=[piece, "\x00never"]), use_tqdm=False)[0].outputs[0]
    cut = full.text.find(piece)
    assert out.text == full.text[:cut]
    assert (out.finish_reason, out.stop_reason) == ("stop", piece)
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) <= 7


def test_stop_string_never_hit_keeps_full_text(tiny_llm) -> None:
    plain = tiny_llm.generate(PROMPTS[3], greedy(10), use_tqdm=False)[0].outputs[0]
    out = tiny_llm.generate(PROMPTS[3], greedy(10, stop="\x00never"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == plain.token_ids
    assert out.text == plain.text


@pytest.fixture(scope="module")
def eos_model(make_tiny_model, reference) -> tuple[Path, list[int], int]:
    """The same weights with ``eos_token_id`` set to a token that greedy decoding of prompt 4 produces."""
    ref = reference["solo"][4]
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    return make_tiny_model(eos_token_id=ref[i]), ref, i


def test_eos_and_ignore_eos(eos_model) -> None:
    path, ref, i = eos_model
    llm = make_llm(path)
    assert ref[i] in llm.engine.eos_token_ids
    out = llm.generate(PROMPTS[4], greedy(20), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = llm.generate(PROMPTS[4], greedy(20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"
    # an explicit stop_token_ids entry still stops even with ignore_eos, and reports the token
    out = llm.generate(PROMPTS[4], greedy(20, ignore_eos=True, stop_token_ids=[ref[i]]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[: i + 1] and out.outputs[0].stop_reason == ref[i]
    assert_no_leaks(llm)


# ------------------------------------------------------------------------------------------- sampling


def test_seeded_sampling_ignores_batch_composition(tiny_llm) -> None:
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone = toks(tiny_llm.generate(PROMPTS[2], p, use_tqdm=False))[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=12),
        SamplingParams(temperature=0.7, seed=5, max_tokens=20),
    ]
    batch = tiny_llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[2]], [others[0], p, others[1], p], use_tqdm=False
    )
    assert toks(batch)[1] == alone and toks(batch)[3] == alone
    assert toks(tiny_llm.generate(PROMPTS[2], p, use_tqdm=False))[0] == alone  # and again later
    other_seed = toks(
        tiny_llm.generate(
            PROMPTS[2], SamplingParams(temperature=1.0, seed=4321, max_tokens=16), use_tqdm=False
        )
    )[0]
    assert other_seed != alone


def test_sampling_filters_that_reduce_to_greedy(tiny_llm, reference) -> None:
    prompts = PROMPTS[1:4]
    expected = [reference["solo"][i][:12] for i in range(1, 4)]
    for kw in (dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6), dict(temperature=1e-7)):
        got = tiny_llm.generate(prompts, SamplingParams(max_tokens=12, seed=3, **kw), use_tqdm=False)
        assert toks(got) == expected, kw


@pytest.mark.parametrize(
    "kw", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2)], ids=["top_k", "top_p", "min_p"]
)
def test_sampling_filters_restrict_support(tiny_llm, hf_model, kw: dict) -> None:
    """Many seeded draws of the first token: all inside the filtered support computed from HF's logits."""
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[4])
    temp = 0.1  # the tiny model's next-token logits are close together: sharpen them so the filters bite
    with torch.no_grad():
        probs = torch.softmax(hf_model(torch.tensor([ids])).logits[0, -1].float() / temp, dim=-1)
    order = probs.argsort(descending=True)
    if "top_k" in kw:
        support = set(order[:3].tolist())
    elif "top_p" in kw:
        cum = probs[order].cumsum(0)
        support = set(order[: int((cum < kw["top_p"]).sum()) + 1].tolist())
    else:
        support = set(torch.nonzero(probs >= kw["min_p"] * probs.max()).flatten().tolist())
    assert 2 <= len(support) < 50, "the filter should leave a small, non-trivial support"
    params = [SamplingParams(temperature=temp, seed=s, max_tokens=1, **kw) for s in range(48)]
    got = {t[0] for t in toks(tiny_llm.generate([{"prompt_token_ids": ids}] * 48, params, use_tqdm=False))}
    assert got <= support
    assert len(got) >= 2
    unfiltered = [SamplingParams(temperature=temp, seed=s, max_tokens=1) for s in range(48)]
    wide = {
        t[0] for t in toks(tiny_llm.generate([{"prompt_token_ids": ids}] * 48, unfiltered, use_tqdm=False))
    }
    assert not wide <= support  # without the filter, draws leave the support


def test_repetition_penalty_matches_hf(tiny_llm, hf_model) -> None:
    ids = tiny_llm.get_tokenizer().encode(PROMPTS[3])
    for penalty in (1.3, 0.8):
        ours = toks(
            tiny_llm.generate(
                {"prompt_token_ids": ids}, greedy(16, repetition_penalty=penalty), use_tqdm=False
            )
        )[0]
        with torch.no_grad():
            hf = hf_model.generate(
                torch.tensor([ids]),
                do_sample=False,
                max_new_tokens=16,
                min_new_tokens=16,
                repetition_penalty=penalty,
            )[0, len(ids) :].tolist()
        assert ours == hf, penalty
    strong = toks(
        tiny_llm.generate({"prompt_token_ids": ids}, greedy(16, repetition_penalty=100.0), use_tqdm=False)
    )[0]
    assert len(set(strong)) == 16 and not set(strong) & set(ids)  # nothing from the context repeats


# ------------------------------------------------------------------------------------------- API forms


def test_generate_input_forms_and_order(tiny_llm, reference) -> None:
    tok = tiny_llm.get_tokenizer()
    one = tiny_llm.generate(PROMPTS[4], greedy(20), use_tqdm=False)
    assert len(one) == 1 and one[0].prompt == PROMPTS[4]
    assert one[0].prompt_token_ids == tok.encode(PROMPTS[4], add_special_tokens=True)
    assert one[0].outputs[0].token_ids == reference["solo"][4]
    assert one[0].outputs[0].text == tok.decode(reference["solo"][4], skip_special_tokens=True)
    by_ids = tiny_llm.generate({"prompt_token_ids": one[0].prompt_token_ids}, greedy(20), use_tqdm=False)
    assert by_ids[0].outputs[0].token_ids == reference["solo"][4] and by_ids[0].prompt is None
    # per-prompt params: the first request runs longest, yet results come back in input order
    prompts = [PROMPTS[0], PROMPTS[1], {"prompt_token_ids": one[0].prompt_token_ids}, PROMPTS[5]]
    params = [greedy(20), greedy(2), greedy(9), greedy(5)]
    outs = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 2, 9, 5]
    assert [o.prompt for o in outs] == [PROMPTS[0], PROMPTS[1], None, PROMPTS[5]]
    assert toks(outs) == [
        reference["solo"][0],
        reference["solo"][1][:2],
        reference["solo"][4][:9],
        reference["solo"][5][:5],
    ]
    assert len({o.request_id for o in outs}) == 4
    with pytest.raises(ValueError, match="3 SamplingParams for 4 prompts"):
        tiny_llm.generate(prompts, params[:3], use_tqdm=False)
    with pytest.raises(TypeError):
        tiny_llm.generate([123], greedy(2), use_tqdm=False)  # type: ignore[list-item]
    assert tiny_llm.generate([], greedy(2), use_tqdm=False) == []


def test_chat_one_or_many(tiny_llm) -> None:
    conv1 = [{"role": "user", "content": "What is a KV cache?"}]
    conv2 = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    tok = tiny_llm.get_tokenizer()
    ids1 = tok.apply_chat_template(conv1, add_generation_prompt=True, tokenize=True)
    ids1 = list(ids1["input_ids"] if not isinstance(ids1, list) else ids1)
    single = tiny_llm.chat(conv1, greedy(8), use_tqdm=False)
    assert len(single) == 1 and single[0].prompt_token_ids == ids1
    assert tok.decode(ids1).endswith("<|im_start|>assistant\n")
    plain = tiny_llm.generate({"prompt_token_ids": ids1}, greedy(8), use_tqdm=False)
    assert toks(single) == toks(plain)
    many = tiny_llm.chat([conv1, conv2], greedy(8), use_tqdm=False)
    assert len(many) == 2 and toks(many)[0] == toks(single)[0]
    assert "Be terse." in tok.decode(many[1].prompt_token_ids) and "Bye" in tok.decode(
        many[1].prompt_token_ids
    )
    with pytest.raises(TypeError):
        tiny_llm.chat([{"content": "no role"}], greedy(2), use_tqdm=False)


def test_chat_template_argument_and_a_model_without_one(tiny_llm, monkeypatch) -> None:
    """vLLM's ``LLM.chat(chat_template=...)`` renders with the given template; a model without a template of its
    own (a base model's checkpoint) is refused with what to do instead, not with the tokenizer's error."""
    conv = [{"role": "user", "content": "What is a KV cache?"}]
    template = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"
    tok = tiny_llm.get_tokenizer()
    want = tok.encode("<<user>> What is a KV cache?\n<<assistant>>", add_special_tokens=False)
    out = tiny_llm.chat(conv, greedy(4), use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == want
    escaped = tiny_llm.apply_chat_template(conv, chat_template=template, escape_special_tokens=True)
    assert tok.decode(escaped) == tok.decode(want)  # (tokens may split differently where text meets template)
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template.*chat_template=.*--chat-template"):
        tiny_llm.chat(conv, greedy(4), use_tqdm=False)
    assert tiny_llm.chat(conv, greedy(4), use_tqdm=False, chat_template=template)[0].prompt_token_ids == want


def test_stream(tiny_llm, reference) -> None:
    stream: Iterator[RequestOutput] = tiny_llm.stream(PROMPTS[4], greedy(12))
    outs = list(stream)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == list(range(1, 13))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert len(texts[-1]) > len(texts[0])
    assert outs[-1].outputs[0].token_ids == reference["solo"][4][:12]
    # a chat conversation streams too; closing the generator early aborts the request without leaking
    chat = tiny_llm.stream([{"role": "user", "content": "Hi"}], greedy(12))
    first = next(chat)
    assert not first.finished
    chat.close()


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.5),
        dict(temperature=float("nan")),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=0),
        dict(top_k=2.5),
        dict(top_k=True),
        dict(min_p=-0.1),
        dict(min_p=1.5),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=float("nan")),
        dict(repetition_penalty=1e3),
        dict(max_tokens=0),
        dict(max_tokens=3.0),
        dict(seed="x"),
        dict(stop=[""]),
        dict(stop=""),
        dict(stop=[1]),
        dict(stop=5),
        dict(stop_token_ids=[-1]),
        dict(stop_token_ids=5),
        dict(ignore_eos="yes"),
    ],
    ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}",
)
def test_sampling_params_validation(kw) -> None:
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name}\b"):
        SamplingParams(**kw)


def test_sampling_params_accepts_valid_values() -> None:
    p = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=0,
        repetition_penalty=1,
        max_tokens=1,
        seed=0,
        stop="x",
        stop_token_ids=[0],
    )
    assert p.greedy and p.stop_list == ["x"]
    assert SamplingParams(stop=["a", "b"]).stop_list == ["a", "b"] and SamplingParams().stop_list == []
    assert not SamplingParams(temperature=0.5).greedy and SamplingParams(temperature=1e-6).greedy


def test_request_errors(tiny_llm) -> None:
    ctx = tiny_llm.engine.max_model_len
    with pytest.raises(ValueError, match="context"):
        tiny_llm.generate({"prompt_token_ids": [5] * (ctx + 1)}, greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="context"):
        tiny_llm.generate({"prompt_token_ids": [5] * ctx}, greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate({"prompt_token_ids": []}, greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        tiny_llm.generate(
            {"prompt_token_ids": [tiny_llm.engine.model_config.vocab_size]}, greedy(1), use_tqdm=False
        )
    with pytest.raises(TypeError, match="SamplingParams"):
        tiny_llm.generate("Hello", {"temperature": 0}, use_tqdm=False)  # type: ignore[arg-type]
    # a failure part-way through a batch leaves nothing running
    with pytest.raises(ValueError):
        tiny_llm.generate(["Hello", {"prompt_token_ids": []}], greedy(2), use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_llm_constructor_errors(tiny_model_dir, tmp_path) -> None:
    with pytest.raises(TypeError, match="bogus_option"):
        LLM(model=str(tiny_model_dir), bogus_option=1)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "no-such-model"))
    bad = tmp_path / "gpt2ish"
    bad.mkdir()
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tiny_model_dir / "model.safetensors", bad / "model.safetensors")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(model=str(bad))
    with pytest.raises(ValueError, match="block_size"):
        LLM(model=str(tiny_model_dir), block_size=0)
    small = make_llm(tiny_model_dir, block_size=4, kv_cache_blocks=12)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate("Hello", greedy(100), use_tqdm=False)
    assert_no_leaks(small)
