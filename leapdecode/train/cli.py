"""``leapdecode train``: drafter training commands."""

from __future__ import annotations


def add_cli(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train drafters (self-distillation data, Medusa heads, exit adapters, small drafts)",
        description="Training commands for the drafters that speculative decoding uses.",
    )
    tsub = p.add_subparsers(dest="train_command", required=True, metavar="TRAIN_COMMAND")
    from leapdecode.train.distill import add_cli as add_distill

    add_distill(tsub)
    from leapdecode.train.self_spec import add_cli as add_self_spec

    add_self_spec(tsub)
    from leapdecode.train.medusa import add_cli as add_medusa

    add_medusa(tsub)
    p.set_defaults(func=lambda a: a.train_func(a))


