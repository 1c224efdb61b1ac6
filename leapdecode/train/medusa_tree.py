"""``leapdecode train medusa-tree``: the Medusa candidate tree from development prompts and this machine's cost.

A trained artifact's tree comes from its validation split (train/medusa.py); this re-derives it from plain greedy
answers to development prompts (the heads' candidate ranks of what actually followed) and picks the default tree
size with this machine's measured step cost, for engines that run without the cost model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from leapdecode.atomic_files import replace_in_folder
from leapdecode.eval.prompts import load_prompt_set, train_prompts_path
from leapdecode.llm import LLM
from leapdecode.sampling_params import SamplingParams
from leapdecode.speculative import tree as T
from leapdecode.speculative.artifacts import CONFIG_FILE, MEDUSA_DIR, load_heads
from leapdecode.speculative.heads import ranked_candidates
from leapdecode.speculative.methods.medusa import DEFAULT_TOP_K
from leapdecode.speculative.policy import StepCostModel, scratch_step
from leapdecode.train.data import TargetPasses


def default_tree_nodes(engine: Any, curve: Seq[float]) -> int:
    """Tree size maximising expected tokens per second at batch 1 on *this* machine (measured step cost);
    stored as the artifact's default for engines that run without the cost model."""
    cost = StepCostModel.calibrate(lambda n: scratch_step(engine.runner, engine.block_manager, n),
                                   sizes=(1, 2, 3, 5, 9, 17, 33), repeats=3)
    best, best_rate = 0, 1.0 / max(cost(1), 1e-9)
    for n in range(1, len(curve)):
        rate = curve[n] / cost(1 + n)
        if rate > best_rate * 1.02:
            best, best_rate = n, rate
    return best


def tune_tree(heads_dir: Path, llm: LLM, prompts: list[str], max_tokens: int, max_nodes: int,
              log=print) -> dict[str, Any]:
    """Rebuild the artifact's tree from the development prompts: plain greedy answers, the heads' merged
    candidates at every answer position, the rank paths of what actually followed; default size from this
    machine's step cost."""
    heads, subset, meta = load_heads(heads_dir)
    eng = llm.engine
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    samples = [{"prompt_token_ids": o.prompt_token_ids, "output_token_ids": o.outputs[0].token_ids}
               for o in outs if o.outputs[0].token_ids]
    w = eng.model.lm_head.get_weight().float()
    lm_w = w if subset is None else w.index_select(0, subset)
    topk = int(meta.get("tree", {}).get("topk", DEFAULT_TOP_K))
    passes = TargetPasses.of_engine(eng)
    ranks_all = []
    d = heads.max_offset
    for s in samples:
        hs = passes.answer_features([s], eng.max_model_len)[0]
        toks = torch.tensor(s["output_token_ids"])
        with torch.no_grad():
            cand = ranked_candidates(F.linear(heads(hs), lm_w), heads, topk)
        if subset is not None:
            cand = subset[cand]
        n = len(toks)
        tg = torch.full((n, d), -1, dtype=torch.long)
        for k in range(1, d + 1):
            tg[: max(0, n - k), k - 1] = toks[k:]
        match = (cand == tg.unsqueeze(2)) & (tg >= 0).unsqueeze(2)
        ranks_all.append(torch.where(match.any(dim=2), match.float().argmax(dim=2), -1))
    ranks = torch.cat(ranks_all)
    counts = T.rank_path_counts(ranks)
    paths = T.top_paths(counts, max_nodes)
    curve = T.expected_tokens_curve(paths, counts, len(ranks))
    tree = {"paths": [list(p) for p in paths], "counts": [counts[p] for p in paths], "num_steps": int(len(ranks)),
            "curve": [round(c, 4) for c in curve], "topk": topk, "source": f"{len(samples)} development prompts"}
    tree["default_nodes"] = default_tree_nodes(eng, curve)
    cfg = json.loads((heads_dir / CONFIG_FILE).read_text())
    cfg.setdefault("tree_validation", cfg.get("tree"))
    cfg["tree"] = tree
    replace_in_folder(heads_dir, CONFIG_FILE, json.dumps(cfg, indent=1).encode("utf-8"))
    log(f"tree from {len(ranks)} development positions: default {tree['default_nodes']} nodes; expected "
        "tokens/step " + ", ".join(f"{n}: {curve[n]:.2f}" for n in (1, 4, 8, 16, 32) if n < len(curve)))
    return tree


def cmd_medusa_tree(args: argparse.Namespace) -> int:
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_blocks=1024)
    prompts_path = args.prompts or str(train_prompts_path())
    prompts = load_prompt_set(prompts_path, args.num_prompts)
    tune_tree(Path(args.heads) if args.heads else MEDUSA_DIR, llm, prompts, args.max_tokens, args.max_nodes)
    return 0


__all__ = ["cmd_medusa_tree", "default_tree_nodes", "tune_tree"]
