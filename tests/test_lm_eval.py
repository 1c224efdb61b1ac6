"""lm-evaluation-harness end to end: its ``local-completions`` model (loglikelihood through ``/v1/completions`` with
echo + logprobs, tokenizing through the server's ``/tokenizer_info`` ``/tokenize`` ``/detokenize``) against a live
server, next to lm-eval's own ``hf`` backend on the same tiny model and a small multiple-choice task the test
writes: the same accuracy and the same per-choice log-likelihoods."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

from leapdecode import LLM  # noqa: E402
from leapdecode.eval.lm_eval_task import write_task  # noqa: E402
from leapdecode.server.api_server import build_app  # noqa: E402
from tests.server_helpers import live_server  # noqa: E402

TASK = "leapdecode_test_mc"
TOL = 2e-3  # per-choice log-likelihood, summed over a few tokens (see test_server_sampling.py)
ITEMS = [
    {"question": q, "choices": choices, "answer": a}
    for q, choices, a in [
        ("The capital of France is", [" Paris", " Berlin", " Rome"], 0),
        ("Two plus two equals", [" three", " four", " five"], 1),
        ("The sky on a clear day is", [" green", " blue"], 1),
        ("Ice is frozen", [" water", " sand", " air"], 0),
        ("A cat says", [" woof", " moo", " meow"], 2),
        ("The sun rises in the", [" east", " west"], 0),
        ("Monday comes after", [" Sunday", " Friday", " Tuesday"], 0),
        ("Bees make", [" milk", " honey"], 1),
        ("The opposite of hot is", [" cold", " warm", " loud"], 0),
        ("A week has seven", [" hours", " days", " years"], 1),
        ("Fish live in", [" trees", " water"], 1),
        ("The first letter of the alphabet is", [" A", " Z", " M"], 0),
    ]
]


def evaluate(model: str, model_args: dict[str, Any], folder: Path) -> dict[str, Any]:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(folder)),
        log_samples=True,
        batch_size=4,
    )


def choice_loglikelihoods(results: dict[str, Any]) -> list[list[float]]:
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def test_local_completions_agrees_with_hf_backend(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setitem(os.environ, "NO_PROXY", "127.0.0.1,localhost")  # lm-eval's requests must stay local
    write_task(tmp_path, TASK, ITEMS)
    llm = LLM(model=str(tiny_model_dir), kv_cache_blocks=128)
    with live_server(build_app(llm)) as base:
        served = evaluate(
            "local-completions",
            {"base_url": base + "/v1/completions", "model": "default", "tokenizer_backend": "remote",
             "tokenized_requests": True, "num_concurrent": 2, "max_retries": 1},
            tmp_path,
        )
    hf = evaluate("hf", {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu"}, tmp_path)
    ours, theirs = choice_loglikelihoods(served), choice_loglikelihoods(hf)
    assert len(ours) == len(ITEMS) and [len(x) for x in ours] == [len(i["choices"]) for i in ITEMS]
    for a, b in zip(ours, theirs, strict=True):
        assert a == pytest.approx(b, abs=TOL)
    assert served["results"][TASK]["acc,none"] == hf["results"][TASK]["acc,none"]
