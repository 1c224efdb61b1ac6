"""``leapdecode train``: the command line of every drafter trainer (each module below holds its ``cmd_*``)."""

from __future__ import annotations

import argparse

from leapdecode.train.adapter import cmd_self_spec
from leapdecode.train.blockwise import BlockwiseTrainConfig, cmd_blockwise
from leapdecode.train.distill import cmd_distill
from leapdecode.train.medusa import MedusaTrainConfig, cmd_medusa, parse_floats
from leapdecode.train.medusa_tree import cmd_medusa_tree

MEDUSA_SUMMARY = "``leapdecode train medusa``: train Medusa heads on the target's own answers (self-distillation)."
BLOCKWISE_SUMMARY = ("``leapdecode train blockwise``: train blockwise decoding's k proposal heads on the target's "
                     "hidden states and its own answers, every block of a stretch in parallel under the "
                     "block-causal mask, with gradient checkpointing per block (train/blockwise.py).")


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train draft-modelers (self-distillation data, Medusa heads, exit adapters, small drafts)",
        description="Training commands for the drafters that speculative decoding uses.",
    )
    tsub = p.add_subparsers(dest="train_command", required=True, metavar="TRAIN_COMMAND")
    _add_distill(tsub)
    _add_adapter(tsub)
    _add_medusa(tsub)
    p.set_defaults(func=lambda a: a.train_func(a))


def _add_distill(tsub: argparse._SubParsersAction) -> None:
    p = tsub.add_parser(
        "distill-data",
        help="generate self-distillation data: the target's own answers to the training prompts",
        description="Runs the target over training prompts (default ../shared/data/prompts/train_prompts.jsonl) "
        "with continuous batching and stores prompt/answer token ids plus a manifest. Resumable: rerunning "
        "with the same --out skips prompts already answered.",
    )
    p.add_argument("--prompts", default=None, help="jsonl with 'prompt' (or 'turns') records")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-prompt-chars", type=int, default=4000, help="skip longer prompts")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--sampled", action="store_true", help="also store one sampled answer per prompt")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(train_func=cmd_distill)


def _add_adapter(tsub: argparse._SubParsersAction) -> None:
    p = tsub.add_parser(
        "self-spec",
        help="train the exit adapter for self-speculation (target layers [0, L) + adapter + shared LM head)",
        description="Caches the target's layer-L hidden states and top-k logits on the distillation data once, "
        "then trains an exit adapter (one decoder layer by default) to match the target's next-token "
        "distribution. Prints held-out top-1 agreement each epoch (epoch 0 = untrained early exit), checkpoints as "
        "it goes (rerun the same command to resume) and writes adapter.safetensors + config.json + record.json "
        "to --out.",
    )
    p.add_argument("--layer", type=int, required=True, help="L: target layers shared by the drafter")
    p.add_argument("--adapter-layers", type=int, default=1, help="decoder layers in the adapter")
    p.add_argument("--init", default="last", choices=["next", "last"],
                   help="start the adapter from the target's last layers (last; better in a probe on SmolLM2 at "
                   "L=15) or from layers L.. (next), the layers that read h_L in the target")
    _adapter_args(p)
    d = tsub.add_parser(
        "draft-model",
        help="distil a small draft model (N decoder layers sharing the target's embedding and LM head)",
        description="Trains a draft of --layers decoder layers (initialised from target layers) over the target's "
        "own embedding, with the target's final norm and LM head, to match the target's next-token distribution "
        "on the distillation data: self-spec with no shared layers, the same cache, loss, validation, checkpoints "
        "and artifact. speculative_config={\"method\": \"draft_model\", \"model\": OUT} drafts with it; "
        "leapdecode/artifacts/draft_model/ is the one used without a path.",
    )
    d.add_argument("--layers", dest="adapter_layers", type=int, default=3,
                   help="decoder layers in the draft (3 of SmolLM2's 30 = 1/10 of its non-embedding parameters)")
    d.add_argument("--init", default="next", choices=["next", "last"],
                   help="start from the target's first layers (next) or its last layers (last)")
    _adapter_args(d)
    d.set_defaults(layer=0)
    e = tsub.add_parser(
        "eagle",
        help="train EAGLE's feature-conditioned draft (the adapter trainer, with feature inputs)",
        description="Trains a draft whose input at each position is the target's final hidden state one position "
        "back fused with the current token's embedding, on the distillation data (the adapter trainer of "
        "`train draft-model`, with feature inputs). speculative_config={\"method\": \"eagle\", \"model\": OUT} "
        "drafts with it; "
        "leapdecode/artifacts/eagle/ is the one used without a path.",
    )
    e.add_argument("--layers", dest="adapter_layers", type=int, default=1, help="decoder layers in the draft")
    e.add_argument("--init", default="next", choices=["next", "last"],
                   help="start from the target's first layers (next) or its last layers (last)")
    _adapter_args(e)
    e.set_defaults(layer=0, features=True)


def _adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="folder with samples.jsonl (leapdecode train distill-data), or it")
    p.add_argument("--out", default=None, help="output folder (default runs/self_spec_L<L> or runs/draft_<N>l)")
    p.add_argument("--model", default=None, help="target model (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", default=None,
                   help="where cached hidden states / teacher logits live (default OUT/cache); share it between "
                   "runs (several L, drafts) so the teacher pass runs once")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training step")
    p.add_argument("--cache-tokens", type=int, default=4096, help="tokens per target forward while caching")
    p.add_argument("--topk", type=int, default=16, help="teacher logits kept per position")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    p.add_argument("--hard-weight", type=float, default=0.0, help="weight of hard CE to the teacher argmax")
    p.add_argument("--vocab-subset", type=int, default=8192,
                   help="score the loss over the N most frequent tokens only (0 = full LM head, ~4x slower "
                   "steps on SmolLM2)")
    p.add_argument("--min-draft-prob", type=float, default=0.3,
                   help="drafting threshold stored in the artifact and used for the confidence metrics")
    p.add_argument("--feature-weight", type=float, default=0.3,
                   help="feature drafts: weight of the smooth-L1 loss to the target's next feature")
    p.add_argument("--chain-steps", type=int, default=2,
                   help="feature drafts: training passes per batch, each after the first fed the draft's own "
                   "features (as the 2nd and later tokens of a chain are drafted)")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--max-records", type=int, default=None, help="use only the first N records")
    p.add_argument("--max-seq-len", type=int, default=1024, help="truncate prompt + answer to this many tokens")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and every epoch)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint in --out")
    p.add_argument("--no-estimate", action="store_true",
                   help="skip timing draft and target steps for the speedup estimate at the end")
    p.set_defaults(train_func=cmd_self_spec, features=False)  # `train eagle` sets features


def _add_medusa(tsub: argparse._SubParsersAction) -> None:
    _heads_parser(tsub, "medusa", "train Medusa heads on self-distillation data (cached hidden states, "
                  "progressive, curriculum)", MEDUSA_SUMMARY, MedusaTrainConfig(data="", out="").layout)
    _add_blockwise(tsub)
    _add_medusa_tree(tsub)


def _add_blockwise(tsub: argparse._SubParsersAction) -> None:
    d = BlockwiseTrainConfig(data="", out="")
    p = tsub.add_parser(
        "blockwise",
        help="train blockwise decoding's block heads (block-causal mask, per-block gradient checkpointing)",
        description=BLOCKWISE_SUMMARY + " Resumable: rerun the same command to continue from WORK/checkpoint/; "
        "--restart starts over.",
    )
    p.add_argument("--data", required=True, help="distill-data folder (samples.jsonl, manifest.json)")
    p.add_argument("--out", required=True, help="artifact folder to write (e.g. leapdecode/artifacts/blockwise)")
    p.add_argument("--work-dir", default=None, help="checkpoints (default DATA/blockwise_work)")
    p.add_argument("--cache-dir", default=None, help="hidden-state cache, shared with `train medusa` "
                   "(default DATA/hidden_cache)")
    p.add_argument("--model", default=None, help="target model (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--num-heads", type=int, default=d.num_heads, help="k: proposals per block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks,
                   help="blocks per training stretch (the heads read the last num_blocks * k tokens)")
    p.add_argument("--attn-heads", type=int, default=d.attn_heads)
    p.add_argument("--head-dim", type=int, default=d.head_dim)
    p.add_argument("--loss-weights", type=parse_floats, default=d.loss_weights, help="by slot, e.g. 1,0.8,0.6,0.4")
    p.add_argument("--vocab-subset", type=int, default=d.vocab_subset, help="most frequent tokens (0 = full)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="stretches per step")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--init-std", type=float, default=d.init_std)
    p.add_argument("--no-grad-checkpoint", dest="grad_checkpoint", action="store_false", default=True,
                   help="keep every block's activations instead of recomputing them per block in backward")
    p.add_argument("--precision", default=d.precision, choices=["bf16", "fp32"])
    p.add_argument("--val-frac", type=float, default=d.val_frac)
    p.add_argument("--val-max-rows", type=int, default=d.val_max_rows)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--stop-after-min", type=float, default=None,
                   help="end this invocation at a checkpoint after N minutes (rerun to continue)")
    p.add_argument("--cache-batch-tokens", type=int, default=d.cache_batch_tokens)
    p.add_argument("--cache-precision", default=d.cache_precision, choices=["bf16", "fp32"])
    p.add_argument("--limit-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.set_defaults(train_func=cmd_blockwise)


def _heads_parser(tsub: argparse._SubParsersAction, name: str, help_text: str, summary: str, layout: str) -> None:
    """The Medusa heads trainer's command line (train/medusa.py) under ``name`` with its default ``--layout``."""
    d = MedusaTrainConfig(data="", out="")
    p = tsub.add_parser(
        name,
        help=help_text,
        description=summary + " Resumable: rerun the same command to continue from "
        "WORK/checkpoint/ (the hidden cache is resumable too); --restart starts over.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help="distill-data folder (samples.jsonl, manifest.json)")
    p.add_argument("--out", required=True, help="artifact folder to write (e.g. leapdecode/artifacts/medusa)")
    p.add_argument("--work-dir", default=None, help="checkpoints (default DATA/medusa_work)")
    p.add_argument("--cache-dir", default=None, help="hidden-state cache (default DATA/hidden_cache)")
    p.add_argument("--model", default=None, help="target model (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--layout", default=layout, help="pyramid (1,2,2,3,3,3,4,4,4,4), one-per-offset, or offsets")
    p.add_argument("--diversity", default=d.diversity, choices=["exclude", "ensemble"])
    p.add_argument("--targets", default=d.targets, choices=["hard", "soft"])
    p.add_argument("--loss-weights", type=parse_floats, default=d.loss_weights, help="by offset, e.g. 1,0.8,0.6,0.4")
    p.add_argument("--temperatures", type=parse_floats, default=d.temperatures, help="by offset, e.g. 1,1.2,1.4,1.6")
    p.add_argument("--vocab-subset", type=int, default=d.vocab_subset, help="most frequent tokens (0 = full)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="answer positions per step")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--time-budget-min", type=float, default=None, help="cap training steps to fit N minutes")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--init-std", type=float, default=d.init_std)
    p.add_argument("--no-progressive", dest="progressive", action="store_false", default=True)
    p.add_argument("--stage-min-frac", type=float, default=d.stage_min_frac)
    p.add_argument("--stage-max-frac", type=float, default=d.stage_max_frac)
    p.add_argument("--stable-tol", type=float, default=d.stable_tol)
    p.add_argument("--stable-window", type=int, default=d.stable_window)
    p.add_argument("--no-curriculum", dest="curriculum", action="store_false", default=True)
    p.add_argument("--curriculum-start", type=int, default=d.curriculum_start)
    p.add_argument("--curriculum-frac", type=float, default=d.curriculum_frac)
    p.add_argument("--grad-checkpoint", action="store_true")
    p.add_argument("--precision", default=d.precision, choices=["bf16", "fp32"])
    p.add_argument("--val-frac", type=float, default=d.val_frac)
    p.add_argument("--val-max-tokens", type=int, default=d.val_max_tokens)
    p.add_argument("--report-topk", type=int, default=d.report_topk)
    p.add_argument("--tree-topk", type=int, default=d.tree_topk)
    p.add_argument("--tree-max-nodes", type=int, default=d.tree_max_nodes)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--cache-batch-tokens", type=int, default=d.cache_batch_tokens)
    p.add_argument("--cache-precision", default=d.cache_precision, choices=["bf16", "fp32"],
                   help="bf16 autocast for the one-off hidden-state pass (faster; inference stays float32)")
    p.add_argument("--limit-samples", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--restart", action="store_true", help="ignore an existing checkpoint")
    p.set_defaults(train_func=cmd_medusa)


def _add_medusa_tree(tsub: argparse._SubParsersAction) -> None:
    t = tsub.add_parser(
        "medusa-tree",
        help="re-derive the Medusa candidate tree from training prompts and this machine's step cost",
        description="Plain greedy answers to the prompts, the heads' candidate ranks of what followed, and the "
        "most frequent rank paths become the tree in HEADS/config.json (the validation tree is kept as "
        "tree_validation).",
    )
    t.add_argument("--heads", default=None, help="artifact folder (default: the shipped heads)")
    t.add_argument("--model", default=None)
    t.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    t.add_argument("--prompts", default=None,
                   help="a prompt set name or question.jsonl path (default: the shared data's training prompts; "
                   "the benchmark sets are held out)")
    t.add_argument("--num-prompts", type=int, default=16)
    t.add_argument("--max-tokens", type=int, default=128)
    t.add_argument("--max-nodes", type=int, default=64)
    t.set_defaults(train_func=cmd_medusa_tree)
