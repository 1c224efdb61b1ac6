"""The strategy router behind ``{"method": "auto"}``: which drafter a request uses, and why.

Three layers of decision, each visible in the request's ``metrics.route`` (``Route.explain``):

1. **The decision tree** (``plan_route``), once per request, from the user's constraints (options.AutoOptions):
   lossless? yes -> does the deployment have to stay unchanged (``minimal_change``)? yes -> speculative decoding
   with a separate drafter (a draft model, then prompt lookup); no -> the Medusa family (drafters that read the
   target's own hidden states: Medusa first, then EAGLE and self-speculation). Lossy allowed -> is the latency
   target extreme (< 10 ms per token)? yes -> non-autoregressive blocks (blockwise heads, every proposed token
   kept); no -> block-parallel decoding (blockwise heads, top-k acceptance). A drafter over the memory budget
   leaves the candidates; a branch with no usable drafter falls back to the next one (a departure, named).
2. **The request**: its task type (``classify_task``: code / math / grounded-on-input / open chat / translation,
   read from the prompt's text by keyword patterns in ~0.4 ms) selects where each drafter's acceptance estimate
   starts: the acceptance this engine has measured for that drafter on earlier requests of the same task
   (``TaskAcceptance``), else the drafter's own prior. Nothing about tasks is assumed; it is learned online.
3. **Each step** (``pick``), among the route's candidates: the speculator's measured rate of each (acceptance x
   step cost at the live batch size). The router takes the tree's most preferred candidate whose rate is within
   ``TREE_MARGIN`` of the best; when the best is clearly faster the route departs from the tree and says so,
   with both rates. While the target's KV pool is nearly full (free share below ``KV_SHORT``) nobody drafts:
   reserved draft slots would push the scheduler into preempting (recomputing) whole sequences. A drafter with
   nothing to propose this step (``Proposer.has_draft``: prompt lookup without a match) is not a candidate for
   it; its acceptance estimate is left as it was, so it is back at once when it has something to offer.

**Domain switching** (``DomainDetector``): per sequence, whether the latest committed tokens repeat what came
before (each token checked against the token that followed the latest occurrence of its bigram: exactly what
prompt lookup would have proposed). When the running share of such tokens crosses into "copying" or falls back to
"writing", the sequence's drafter estimates are reset (prompt lookup's to the measured copy rate, the others to
their starting point), so the per-step choice moves to the drafter that fits the new text at once, instead of
waiting for acceptance averages to decay.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.sequence import Sequence
from leapdecode.speculative.difficulty import COMPUTE_PATHS, choose_path, narrow, update_signal
from leapdecode.speculative.options import check, is_prob
from leapdecode.speculative.state import DomainState, DraftState, Route

TaskType = Literal["code", "math", "grounded", "chat", "translation"]
# "rate": each step's pick by measured rate alone; "difficulty": the target's confidence first narrows the pick to
# plain decoding, speculative decoding or the layer-skip self-draft (difficulty.py)
ComputePathRule = Literal["rate", "difficulty"]

EXTREME_LATENCY_MS = 10.0  # the tree's "extreme latency" bar, per output token
TREE_MARGIN = 0.05  # the tree's choice stands while its measured rate is within 5% of the best candidate's
KV_SHORT = 0.1  # below this free share of the target's KV pool, no sequence drafts
MIN_TASK_DRAFTS = 32  # drafts of a (task, drafter) pair before its measured acceptance replaces the prior
# the copy detector: EMA weight of each token's hit, tokens before it may settle, and its two thresholds
# (hysteresis, so a sequence at the border does not flap between domains)
DOMAIN_EMA = 0.15
DOMAIN_WARMUP = 8
COPYING_ABOVE = 0.6
WRITING_BELOW = 0.25
AUTO = "auto"  # the method name of the router itself
# shared keys of its candidates that auto does not read: it always sizes drafts by the step-cost model
AUTO_IGNORES = frozenset({"use_cost_model"})

@dataclass(frozen=True)
class AutoOptions:
    """``auto``'s options. ``methods`` narrows the drafters it chooses among (None: every usable one; the registry
    checks the names). The user's constraints: ``lossless`` (False allows the lossy branch: lossy block-parallel
    decoding where such heads fit the model), ``minimal_change`` (only drafters that leave the target
    untouched, no drafter that reads the target's hidden states), ``latency_slo_ms`` (target time per output
    token: below 10 ms on the lossy branch the router drafts whole blocks without verification rejecting them),
    ``memory_budget_mb`` (the most memory a drafter may hold of its own: weights, caches), ``switch_domains``
    (watch each request for copying vs free writing and re-weigh its drafters when that changes),
    ``compute_path`` (``"difficulty"``: per step, plain decoding, speculative decoding or the target's layer-skip
    draft from the target's top-1 margin over recent steps, with ``easy_above`` and ``hard_below`` its two
    thresholds; difficulty.py)."""

    methods: tuple[str, ...] | None = None
    lossless: bool = True
    minimal_change: bool = False
    latency_slo_ms: float | None = None
    memory_budget_mb: float | None = None
    switch_domains: bool = True
    compute_path: ComputePathRule = "rate"
    easy_above: float = 0.6
    hard_below: float = 0.2

    def __post_init__(self) -> None:
        m = self.methods
        if isinstance(m, list):
            object.__setattr__(self, "methods", m := tuple(m))
        check(m is None or (isinstance(m, tuple) and len(m) > 0 and all(isinstance(x, str) for x in m)),
              f'auto\'s "methods" must be a non-empty list of method names, got {m!r}')
        for key in ("lossless", "minimal_change", "switch_domains"):
            check(isinstance(getattr(self, key), bool), f"{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("latency_slo_ms", "memory_budget_mb"):
            v = getattr(self, key)
            check(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
                  f"{key} must be a positive number (or null: no constraint), got {v!r}")
        check(self.compute_path in ("rate", "difficulty"),
              f'compute_path must be "rate" or "difficulty", got {self.compute_path!r}')
        check(is_prob(self.easy_above) and is_prob(self.hard_below) and self.hard_below <= self.easy_above,
              f"need 0 <= hard_below <= easy_above <= 1, got hard_below={self.hard_below!r}, "
              f"easy_above={self.easy_above!r}")


def extreme_latency(opts: AutoOptions) -> bool:
    """Whether the user's latency target is on the tree's "extreme" side (below ``EXTREME_LATENCY_MS``)."""
    return opts.latency_slo_ms is not None and opts.latency_slo_ms < EXTREME_LATENCY_MS


# --------------------------------------------------------------------------------------------- task type
_STRONG_CODE = re.compile(r"```|\bdef \w+\(|\bclass \w+[:(]|#include|>>>|\"\"\"|'''|\bimport \w+|"
                          r"\bwrite an? ([\w+#]+ ){0,3}(program|function|script|class|method|query|regex)\b|"
                          r"\bimplement\b", re.I)
_CODE = re.compile(r"\b(python|javascript|java|c\+\+|rust|sql|html|css|bash|regex|typescript|golang|numpy|pandas)\b|"
                   r"\b(code|coding|program|programming|script|algorithm|compile|debug|bug|api|function|array|"
                   r"string|tree|node|linked list)\b", re.I)
_STRONG_MATH = re.compile(r"\b\w\s*[-+*/^=<>]\s*\w\b|\|\s*\w\s*[-+]|\b[a-z]\(\w\)|\$\d|"
                          r"\b(solve|equations?|probability|integral|derivative|polynomial|inequality|theorem)\b", re.I)
_MATH = re.compile(r"\b(calculate|compute|sum of|how many|prove|percent|ratio|area|triangle|math|numbers?|digits?|"
                   r"prime|average|divisible|total|cost|price[sd]?)\b|\d+%", re.I)
_TRANSLATE = re.compile(r"\btranslat(e|ion) (this|the|it|following|into|to|from)\b|\b(into|to) (english|french|"
                        r"spanish|german|chinese|japanese|italian|portuguese|russian|korean|arabic|dutch|hindi)\b",
                        re.I)
_STRONG_GROUNDED = re.compile(r"\b(read|given|use|using|evaluate|analy[sz]e|based on) (the )?(following|below|"
                              r"above|this|these)\b|\b(following|below|above) (text|passage|article|paragraph|"
                              r"document|data|table|email|story|reviews?|context|sentences?|information|report|"
                              r"excerpt|records?)\b|\b(paragraph|passage|text|article) below\b", re.I)
_GROUNDED = re.compile(r"\b(extract|summari[sz]e|according to the|from the (text|passage|article)|identify the|"
                       r"rewrite|proofread|paraphrase)\b", re.I)
LONG_INPUT_CHARS = 700  # a prompt this long carries material to work on (counts toward "grounded")


def classify_task(text: str) -> TaskType:
    """The task a prompt asks for, from weighted keyword patterns over its first 4000 characters (a translation
    request wins outright; otherwise the best of code / grounded / math scoring at least 2, else open chat).
    Measured on 80 MT-Bench first turns, 164 HumanEval and 100 MBPP prompts: docs/speculative.md."""
    t = text[:4000]
    if _TRANSLATE.search(t):
        return "translation"
    scores: dict[TaskType, int] = {
        "code": 3 * len(_STRONG_CODE.findall(t)) + len(_CODE.findall(t)),
        "grounded": 3 * len(_STRONG_GROUNDED.findall(t)) + len(_GROUNDED.findall(t))
        + (2 if len(t) > LONG_INPUT_CHARS else 0),
        "math": 2 * len(_STRONG_MATH.findall(t)) + len(_MATH.findall(t)),
    }
    best = max(scores, key=lambda k: scores[k])
    return best if scores[best] >= 2 else "chat"


# -------------------------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class DrafterFacts:
    """What the tree needs to know of one built drafter: its name, the memory it holds of its own (MB), and where
    its method's descriptor puts it: the branch (``method.AutoBranch``: "separate", "hidden" or "lossy") and its
    preference there (lowest first); whether it drafts with the target itself (the difficulty path's self-draft)."""

    name: str
    memory_mb: float
    branch: str
    rank: int
    self_draft: bool = False


def _within_budget(facts: list[DrafterFacts], budget_mb: float | None, departures: list[str]) -> list[DrafterFacts]:
    kept = []
    for f in facts:
        if budget_mb is not None and f.memory_mb > budget_mb:
            departures.append(f"{f.name} holds {f.memory_mb:.0f} MB > memory_budget_mb {budget_mb:g}")
            continue
        kept.append(f)
    return kept


def _on_branch(facts: list[DrafterFacts], branch: str) -> list[str]:
    """The drafters of ``branch`` in the tree's order of preference."""
    return [f.name for f in sorted((f for f in facts if f.branch == branch), key=lambda f: f.rank)]


def plan_route(task: str, opts: AutoOptions, facts: list[DrafterFacts]) -> Route:
    """The tree's branch for a request of ``task`` under the user's constraints ``opts``, over the built
    drafters ``facts`` (module docstring, layer 1): candidates in the tree's preference order."""
    departures: list[str] = []
    usable = _within_budget(facts, opts.memory_budget_mb, departures)
    branch: list[str] = []
    if not opts.lossless:
        branch.append("lossy allowed")
        branch.append("latency < 10 ms/token: non-autoregressive blocks" if extreme_latency(opts) else
                      "block-parallel decoding")
        lossy = _on_branch(usable, "lossy")
        if lossy and not opts.minimal_change:
            return Route(task, branch, tuple(lossy[:1]), departures)
        departures.append(f"minimal change rules out {lossy[0]} (it reads the target's hidden states): the "
                          "lossless branch instead" if opts.minimal_change and lossy else
                          "no lossy drafter fits this model (or budget): the lossless branch instead")
        branch = ["lossy allowed, no lossy drafter"]
    branch.append("lossless")
    separate = _on_branch(usable, "separate")
    family = _on_branch(usable, "hidden")
    if opts.minimal_change:
        branch.append("minimal change: speculative decoding")
        return Route(task, branch, tuple(separate), departures)
    branch.append("change allowed: Medusa")
    if not family:
        departures.append("no drafter reads this target's hidden states here: speculative decoding instead")
    return Route(task, branch, tuple(family + separate), departures)


def pick(route: Route, rates: dict[str, tuple[int, float]]) -> tuple[str | None, int, str | None]:
    """Among the candidates that would draft (``rates``: name -> (tokens, tokens per second), only those that
    beat plain decoding), the tree's most preferred one within ``TREE_MARGIN`` of the best rate. Returns (method,
    tokens, departure note or None: the tree's first choice was not taken, and why); (None, 0, None) when none
    would draft."""
    if not rates:
        return None, 0, None
    top = max(rate for _, rate in rates.values())
    name = next(n for n in route.candidates if n in rates and rates[n][1] >= (1.0 - TREE_MARGIN) * top)
    first = route.candidates[0]
    if name == first:
        return name, rates[name][0], None
    if first not in rates:
        why = "does not beat plain decoding at this batch"
    else:
        why = f"measured {rates[first][1]:.1f} tok/s < {rates[name][1]:.1f}"
    return name, rates[name][0], f"{first} -> {name}: {first} {why}"


# ---------------------------------------------------------------------------------- measured per task
class TaskAcceptance:
    """Acceptance measured per (task, drafter) over finished requests: where a new request's estimate starts."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], list[int]] = {}

    def record(self, task: str, method: str, drafted: int, accepted: int) -> None:
        c = self.counts.setdefault((task, method), [0, 0])
        c[0] += drafted
        c[1] += accepted

    def acceptance(self, task: str, method: str) -> float | None:
        """The measured per-token acceptance, or None below ``MIN_TASK_DRAFTS`` drafts."""
        drafted, accepted = self.counts.get((task, method), (0, 0))
        return accepted / drafted if drafted >= MIN_TASK_DRAFTS else None


# ------------------------------------------------------------------------------------- domain switching
class DomainDetector:
    """Copying vs free writing, per sequence (module docstring); ``update`` returns the new domain on a switch."""

    def update(self, seq: Sequence, st: DomainState) -> str | None:
        toks = seq.token_ids
        start = max(st.done, seq.num_prompt_tokens)
        # index the prompt's bigrams first (no hits counted there: only generated text shows the domain)
        for i in range(max(st.done, 2), min(start, len(toks))):
            st.next_of[(toks[i - 2], toks[i - 1])] = toks[i]
        for i in range(max(start, 2), len(toks)):
            key = (toks[i - 2], toks[i - 1])
            hit = float(st.next_of.get(key) == toks[i])
            st.hit_rate = hit if st.seen == 0 else st.hit_rate + DOMAIN_EMA * (hit - st.hit_rate)
            st.seen += 1
            st.next_of[key] = toks[i]
        st.done = len(toks)
        if st.seen < DOMAIN_WARMUP:
            return None
        new = st.domain
        if st.hit_rate > COPYING_ABOVE:
            new = "copying"
        elif st.hit_rate < WRITING_BELOW:
            new = "writing"
        switched = st.domain is not None and new != st.domain
        st.domain = new
        return new if switched else None


# ---------------------------------------------------------------------------------------------- router
class Router:
    """The per-engine router: built from ``auto``'s options and the drafters the speculator built; the
    speculator asks it for each request's route, each step's pick, and tells it what each request measured."""

    def __init__(self, opts: AutoOptions, facts: list[DrafterFacts], decode: Callable[[list[int]], str],
                 dropped: dict[str, float] | None = None) -> None:
        self.opts = opts
        self.facts = facts
        self.decode = decode  # token ids -> text, for the task classifier
        self.dropped = dict(dropped or {})  # drafters left out at start-up as unprofitable -> measured acceptance
        self.tasks = TaskAcceptance()
        self.detector = DomainDetector()

    def route(self, seq: Sequence, st: DraftState) -> Route:
        """The request's route, planned on first use (module docstring, layers 1-2)."""
        if st.route is None:
            st.route = plan_route(classify_task(self.decode(seq.prompt_token_ids)), self.opts, self.facts)
            st.route.departures[:0] = [f"{name} left out: its measured acceptance {acceptance:.2f} cannot pay for "
                                       "its step cost on this machine" for name, acceptance in self.dropped.items()]
            seq.metrics.route = st.route.explain()
        return st.route

    @staticmethod
    def kv_short(bm: BlockManager) -> bool:
        """Whether the target's KV pool is too full for anyone to draft (module docstring, layer 3)."""
        return bm.num_free_blocks < KV_SHORT * bm.num_blocks

    def prior(self, seq: Sequence, st: DraftState, method: str, default: float) -> float:
        """Where ``seq``'s acceptance estimate for ``method`` starts: measured on its task, else ``default``."""
        measured = self.tasks.acceptance(self.route(seq, st).task, method)
        return default if measured is None else measured

    def depart(self, seq: Sequence, st: DraftState, note: str) -> None:
        """Record a departure once per request and kind (the text before its first colon)."""
        route = self.route(seq, st)
        kind = note.split(":", 1)[0]
        if not any(d.split(":", 1)[0] == kind for d in route.departures):
            route.departures.append(note)
            seq.metrics.route = route.explain()

    def domain_switch(self, seq: Sequence, st: DraftState) -> str | None:
        """Feed the copy detector the sequence's new tokens; the new domain on a switch (recorded), else None."""
        if not self.opts.switch_domains:
            return None
        new = self.detector.update(seq, st.domain)
        if new is not None:
            seq.metrics.num_domain_switches += 1
            self.depart(seq, st, f"domain switch to {new} at output token {seq.num_output_tokens}")
        return new

    # -------------------------------------------------------------------------------- compute path (difficulty)
    def observe_logits(self, st: DraftState, logits: torch.Tensor) -> None:
        """The target's logits [V] at the row behind the step's last committed token: the difficulty signal."""
        if self.opts.compute_path == "difficulty":
            update_signal(st.difficulty, logits)

    def compute_path(self, seq: Sequence, st: DraftState, names: list[str],
                     ready: Callable[[str], bool]) -> list[str]:
        """The route's candidates ``names`` narrowed to this step's compute path (difficulty.py; ``ready(name)``:
        whether that drafter has something to propose). The path is counted in ``metrics.compute_paths``, and the
        first step of each path in a request says why in the route."""
        if self.opts.compute_path != "difficulty":
            return names
        route = self.route(seq, st)
        selfs = {f.name for f in self.facts if f.self_draft}
        ready_self = any(n in selfs and ready(n) for n in names)
        path, why = choose_path(st.difficulty, route.task, st.domain.domain == "copying", ready_self,
                                self.opts.easy_above, self.opts.hard_below)
        paths = seq.metrics.compute_paths
        paths[path] = paths.get(path, 0) + 1
        if path != st.difficulty.path:
            st.difficulty.path = path
            self.depart(seq, st, f"compute path {path}: {why}")
        return narrow(path, names, selfs)

    def finish(self, st: DraftState) -> None:
        """Fold the request's measured acceptance per drafter into its task's record."""
        route = st.route
        if route is None:
            return
        for method, g in st.gamma.items():
            if g.drafted:
                self.tasks.record(route.task, method, g.drafted, g.accepted)


__all__ = [
    "AUTO",
    "AUTO_IGNORES",
    "AutoOptions",
    "COMPUTE_PATHS",
    "ComputePathRule",
    "DomainDetector",
    "DrafterFacts",
    "Router",
    "TaskAcceptance",
    "TaskType",
    "classify_task",
    "extreme_latency",
    "pick",
    "plan_route",
]
