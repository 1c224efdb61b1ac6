"""End-of-turn stops: every end id a checkpoint declares (GGUF ``eot_token_id``/``eom_token_id``, HF
``generation_config.json`` lists) and the special token a chat template closes an assistant turn with end a
generation, as the model's end of sequence does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer, LlamaForCausalLM

from leapdecode import SamplingParams
from leapdecode.config import EngineConfig
from leapdecode.engine.llm_engine import LLMEngine
from leapdecode.models.loader import load_config, load_model
from leapdecode.models.stops import gguf_end_ids, hf_end_ids, template_end_ids
from tests.family_models import write_gguf

EOT = 17  # an end-of-turn id that is not the end of sequence (2)


def test_gguf_and_hf_end_ids(tmp_path: Path) -> None:
    fields = {"tokenizer.ggml.eos_token_id": np.array(2), "tokenizer.ggml.eot_token_id": 9,
              "tokenizer.ggml.eom_token_id": 9}
    assert gguf_end_ids(fields) == [2, 9]
    assert gguf_end_ids({}) == []
    assert hf_end_ids(tmp_path, {"eos_token_id": 2}) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 128008, 128009]}))
    assert hf_end_ids(tmp_path, {"eos_token_id": 2}) == [2, 128008, 128009]


def test_template_end_token(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert template_end_ids(tok) == [tok.eos_token_id]  # ChatML: <|im_end|> is already the end of sequence
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|endoftext|>\n{% endfor %}"
    assert template_end_ids(tok) == [tok.eos_token_id, endoftext]
    tok.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"  # plain text after
    assert template_end_ids(tok) == [tok.eos_token_id]
    tok.chat_template = "{{ raise_exception('system turn first') }}"
    assert template_end_ids(tok) == [tok.eos_token_id]


def test_hf_generation_config_ends_are_read(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, EOT]}))
    assert load_config(folder).eos_token_ids == [2, EOT]


@pytest.fixture(scope="module")
def eot_gguf(tiny_model_dir: Path, tmp_path_factory) -> Path:
    model = LlamaForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    return write_gguf(model, tmp_path_factory.mktemp("eot") / "tiny-eot.gguf", eot_token_id=EOT)


def test_gguf_eot_ends_generation(eot_gguf: Path, tokenizer_dir: Path) -> None:
    """A GGUF whose end of turn (17) differs from its end of sequence (2): generating the end of turn stops the
    request, as llama.cpp does; before, only the end of sequence was read and the model ran on."""
    assert load_config(eot_gguf).eos_token_ids == [2, EOT]
    model, _ = load_model(eot_gguf)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    engine = LLMEngine(EngineConfig(model=str(eot_gguf), kv_cache_blocks=32), model=model, tokenizer=tok,
                       model_path=eot_gguf)
    assert EOT in engine.eos_token_ids

    def run(bias_token: int) -> tuple[list[int], str | None]:
        params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={bias_token: 100.0})
        rid = engine.add_request(tok.encode("Hello"), params)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    return out.outputs[0].token_ids, out.outputs[0].finish_reason

    assert run(EOT) == ([EOT], "stop")
    tokens, reason = run(EOT + 1)  # any other token: it runs to max_tokens
    assert reason == "length" and len(tokens) == 8


def test_gguf_without_kernels_is_a_clear_error(eot_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler: a GGUF model on a CPU is refused with the reason and the way on, instead of a silent float32
    copy of its weights; ``linear_kernel="torch"`` (keep_blocks=False) asks for that copy."""
    from leapdecode.models import loader

    def no_kernel(required: bool = False):
        if required:
            raise RuntimeError('linear_kernel="packed" but the kernel could not be built: FileNotFoundError: g++')
        return None

    monkeypatch.setattr(loader, "load_kernel", no_kernel)
    with pytest.raises(RuntimeError, match=r"could not be built \(FileNotFoundError: g\+\+\).*GiB.*--linear-kernel"):
        load_model(eot_gguf)
    model, _ = load_model(eot_gguf, keep_blocks=False)  # the float32 copy, asked for
    assert model.config.eos_token_ids == [2, EOT]
