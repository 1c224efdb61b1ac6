"""The compute path by difficulty (``{"method": "auto", "compute_path": "difficulty"}``): per request and per step,
plain decoding, speculative decoding or the target's own layer-skip draft, chosen from how sure the target is.

**The signal.** After every step the router reads the target's logits at the row behind the step's last committed
token (what the token was drawn from) and keeps, per sequence, running averages (weight ``SIGNAL_EMA``: about the
last five steps) of the top-1 probability and of the *margin*, top-1 minus top-2 probability. A large margin
means the next tokens are easy for the target: a cheap draft (the target with layers left out) agrees with it
and long chains are accepted. A small margin means the target itself hesitates: whatever a drafter proposes is
often rejected, and a rejected draft still cost its verified rows.

**The paths** (``choose_path``), every one lossless (each draft is verified by the target):

```
fewer than WARMUP_STEPS measured ----------------------------------------------- speculative
the copy detector says the text copies earlier text ---------------------------- speculative
margin < hard_below ── the task (classifier) works on its input (grounded, code)? ── yes: speculative
                                                                                 └─ no: plain decoding
margin >= easy_above and a self-draft has a skip set ---------------------------- self-draft first
otherwise (medium) -------------------------------------------------------------- speculative
```

"speculative" is the route's drafters without the self-draft, and the per-step pick among them by measured rate
still decides (the best one, or plain decoding where none pays); "self-draft first" puts the layer-skip draft at
the head of the route's preference, the others behind it, so the pick takes it wherever its rate is within the
tree's margin of the best. Tasks that work on their input keep the lookup drafters on hard text: those match the
input where it is copied, whatever the target's confidence elsewhere. There is no lossy branch: emitting a cheap
path's tokens without verification would change the output by an amount nothing here measures.
"""

from __future__ import annotations

from typing import Literal

import torch

from leapdecode.speculative.state import DifficultyState

ComputePath = Literal["plain", "speculative", "self_draft"]
COMPUTE_PATHS: tuple[str, ...] = ("plain", "speculative", "self_draft")
SIGNAL_EMA = 0.3  # weight of the newest step in the running averages
WARMUP_STEPS = 3  # steps measured before the signal chooses
INPUT_TASKS = ("grounded", "code")  # tasks (router.classify_task) whose text copies from the input


def row_signal(logits: torch.Tensor) -> tuple[float, float]:
    """(top-1 probability, top-1 minus top-2 probability) of one row of logits [V]."""
    row = logits.float().reshape(-1)
    top = row.topk(min(2, row.numel())).values
    lse = row.logsumexp(dim=-1)
    p = (top - lse).exp().tolist()
    return p[0], p[0] - (p[1] if len(p) > 1 else 0.0)


def update_signal(st: DifficultyState, logits: torch.Tensor) -> None:
    """Fold one step's row into the sequence's running averages."""
    top1, margin = row_signal(logits)
    if st.steps == 0:
        st.top1, st.margin = top1, margin
    else:
        st.top1 += SIGNAL_EMA * (top1 - st.top1)
        st.margin += SIGNAL_EMA * (margin - st.margin)
    st.steps += 1


def choose_path(st: DifficultyState, task: str, copying: bool, self_draft_ready: bool, easy_above: float,
                hard_below: float) -> tuple[ComputePath, str]:
    """The path for this step and why (module docstring's tree); ``self_draft_ready``: a self-draft is among the
    route's drafters and has something to propose."""
    if st.steps < WARMUP_STEPS:
        return "speculative", f"warming up (under {WARMUP_STEPS} steps measured)"
    if copying:
        return "speculative", "the text copies earlier text"
    m = st.margin
    if m < hard_below:
        if task in INPUT_TASKS:
            return "speculative", f"hard (top-1 margin < {hard_below:g}) but a {task} task: lookup stays"
        return "plain", f"hard: top-1 margin < {hard_below:g} over recent steps"
    if m >= easy_above and self_draft_ready:
        return "self_draft", f"easy: top-1 margin >= {easy_above:g} over recent steps"
    if m >= easy_above:
        return "speculative", f"easy (top-1 margin >= {easy_above:g}) but no self-draft ready"
    return "speculative", f"medium: top-1 margin in [{hard_below:g}, {easy_above:g})"


def narrow(path: ComputePath, names: list[str], self_drafts: set[str]) -> list[str]:
    """The route's candidates ``names`` (in preference order) on ``path``."""
    if path == "plain":
        return []
    if path == "speculative":
        return [n for n in names if n not in self_drafts]
    return [n for n in names if n in self_drafts] + [n for n in names if n not in self_drafts]


__all__ = ["COMPUTE_PATHS", "INPUT_TASKS", "SIGNAL_EMA", "WARMUP_STEPS", "ComputePath", "choose_path", "narrow",
           "row_signal", "update_signal"]
