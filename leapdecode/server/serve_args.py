"""The ``serve`` flags users bring from vLLM: a positional model (``leapdecode serve MODEL``), ``--config FILE.yaml``
(keys are flag names; the command line wins), the engine flags (``--gpu-memory-utilization``, ``--enforce-eager``,
``--swap-space``, ``--seed``, ``--revision``, ``--tokenizer``; unset ones keep the engine's defaults), the chat
answer's parsers (``--tool-call-parser``, ``--reasoning-parser``), the pooling of ``/v1/embeddings``, the stats
log (``--log-interval``, ``--disable-log-stats``) and whether outputs join other requests' drafts by default
(``--no-share-output``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from leapdecode.server.chat_output import REASONING_PARSER_OPTIONS, TOOL_CALL_PARSER_OPTIONS
from leapdecode.server.embeddings import POOLINGS

DEFAULT_LOG_INTERVAL_S = 10.0
# flag dest -> the engine (LLM) argument it sets, when given
ENGINE_FLAGS = {
    "gpu_memory_utilization": "gpu_memory_utilization",
    "enforce_eager": "enforce_eager",
    "swap_space": "swap_space_gb",
    "seed": "seed",
    "tokenizer": "tokenizer",
    "revision": "revision",
}


def add_user_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model: a .gguf file, an HF folder, org/name or org/name:QUANT")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read flags from a YAML file (keys are flag names, e.g. max-num-seqs: 8); flags given on the "
                        "command line win")
    p.add_argument("--revision", default=None, help="the Hub revision (branch, tag or commit) of a repo id model")
    p.add_argument("--tokenizer", default=None,
                   help="load the tokenizer from this folder, .gguf file or repo id instead of the model's")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the share of the GPU's memory this engine may hold (default: the engine's, 0.9)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="CUDA: never capture CUDA graphs")
    p.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                   help="host memory for the KV of preempted requests (default: 0, preemption recomputes)")
    p.add_argument("--seed", type=int, default=None, help="the engine's random seed (default: 0)")
    p.add_argument("--tool-call-parser", default="auto", choices=TOOL_CALL_PARSER_OPTIONS,
                   help='how tool_choice "auto" reads calls in the model\'s text (default: auto, from the chat '
                        "template)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: \"auto\" is on whenever a tool-call parser is known")
    p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSER_OPTIONS,
                   help="split <think> text into reasoning_content: auto (default: when the chat template has think "
                        "tags), none, qwen3, deepseek_r1")
    p.add_argument("--embedding-pooling", default="last", choices=POOLINGS,
                   help="/v1/embeddings: the last token's hidden state (default) or the mean of all, normalised")
    p.add_argument("--log-interval", type=float, default=DEFAULT_LOG_INTERVAL_S, metavar="S",
                   help=f"log engine stats every S seconds while there is work (default: {DEFAULT_LOG_INTERVAL_S:g})")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines")
    p.add_argument("--no-share-output", action="store_true",
                   help="requests that do not set share_output keep their outputs out of what other requests draft "
                        "from (the suffix method's global tree); for a server shared by users who must not see each "
                        "other's text (default: shared, as in the Python API)")


def _action(parser: argparse.ArgumentParser, key: str) -> argparse.Action:
    dest = key.replace("-", "_")
    for action in parser._actions:
        if action.dest == dest or (dest == "model" and action.dest == "model_tag"):
            if action.dest not in ("help", "config"):
                return action
    raise ValueError(f"--config: unknown key {key!r} (keys are serve's flag names, e.g. max-num-seqs)")


def _value(action: argparse.Action, key: str, value: Any) -> Any:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # a switch
        if not isinstance(value, bool):
            raise ValueError(f"--config: {key} is a switch, give true or false, got {value!r}")
        return value
    if isinstance(value, str) and action.type is not None:
        value = action.type(value)
    elif isinstance(value, (int, float)) and action.type in (int, float):
        if action.type is int and not float(value).is_integer():
            raise ValueError(f"--config: {key} must be an integer, got {value!r}")
        value = action.type(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"--config: {key} must be one of {', '.join(map(str, action.choices))}, got {value!r}")
    return value


def apply_config_file(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill ``args`` from ``--config``'s YAML mapping where the command line left a flag at its default."""
    if args.config is None:
        return
    path = Path(args.config).expanduser()
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--config: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config: {path} is not valid YAML: {e}") from None
    if data is None:
        return
    if not isinstance(data, dict):
        raise ValueError(f"--config: {path} must hold a mapping of flag names to values")
    for key, value in data.items():
        action = _action(parser, str(key))
        if getattr(args, action.dest) == action.default:  # the command line wins
            setattr(args, action.dest, _value(action, str(key), value))


def resolve_model_arg(args: argparse.Namespace) -> None:
    """The positional model and ``--model`` name one model."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of the flags given (unset ones keep the engine's defaults)."""
    return {arg: getattr(args, flag) for flag, arg in ENGINE_FLAGS.items() if getattr(args, flag) is not None}
