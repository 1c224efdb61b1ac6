"""Self-speculation: draft with the target's own first L layers plus a trained exit adapter (Kangaroo-style).

The drafter is ``LMHead(norm(adapter(h_L)))``: ``h_L`` is the target's residual stream after its first ``L``
layers, the adapter is one decoder layer plus an RMSNorm trained to map it to the target's next-token
distribution (``leapdecode train self-spec``), and the LM head is the target's own (tied), so there is no second
model to load or keep in step with the tokenizer.

What is shared, and why nothing is computed twice for committed tokens:

- **Layers [0, L)** run *in the target's own KV cache*. A draft step feeds one token per sequence (the last
  committed token, then each draft) at its real position, so its layer-[0, L) K/V land in the target's slots
  beyond the committed length. The verification pass recomputes every layer for those positions anyway and
  overwrites them; for accepted tokens it writes exactly what the draft wrote (same inputs), so the drafter
  never has to recompute the shared layers for tokens it has already drafted and never runs them over a prompt.
- **h_L for committed tokens** comes from the target: the engine's runner hands every full pass's layer-L
  residual stream to :meth:`SelfSpecProposer._capture` (``ModelRunner.add_capture``), which files it by KV slot in
  ``h_pool`` (one hidden vector per target slot, ~5% of a float KV cache) with the position and token id it
  belongs to. A prompt, or the last draft of a fully accepted chain (which the drafter never fed), is caught up
  by running *only the adapter* on those stored rows.
- **The adapter's K/V** is the only state the drafter owns: a paged cache of its layers with its own block
  tables (``adapter_bm``), rolled back to the committed prefix after each verification (``on_verified``) and freed
  when the request ends (``release``).

Counters (``num_shared_tokens`` = rows the drafter put through layers [0, L), ``num_adapter_tokens``,
``num_catchup_tokens``, ``num_fallback_tokens``) make "never recomputes the shared layers for accepted tokens"
testable: per drafted chain of k tokens the drafter runs exactly k rows through the shared layers.

When a tree's accepted nodes are compacted into sequential slots, ``h_pool`` follows the K/V
(``ModelRunner.copy_slots`` calls ``_copy_slots``). The fallback: when a stored ``h_L`` still does not carry the
expected (position, token) tag (another pass overwrote the slot), the drafter recomputes the shared layers for
those committed positions, reading the target's committed K/V but writing its own K/V to a scratch slot beyond
the committed length, so the target's cache for committed tokens is never touched.

Drafting stops early when the draft's top probability falls below ``min_draft_prob`` (speculative config key,
default from the artefact, else 0.3): a low-confidence draft is rarely accepted and costs a verification row.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.engine.block_manager import BlockManager
from leapdecode.engine.kv_cache import KVCache
from leapdecode.engine.model_runner import ForwardItem, ModelRunner
from leapdecode.engine.sequence import Sequence
from leapdecode.layers import small_gemm
from leapdecode.layers.attention import AttentionMetadata
from leapdecode.layers.linear import ReplicatedLinear, shard_tensor
from leapdecode.layers.rotary import apply_rotary
from leapdecode.layers.sampler import processed_probs, sample_from
from leapdecode.models.config import ModelConfig
from leapdecode.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm
from leapdecode.spec.draft_model import ShadowCacheProposer, _Shadow
from leapdecode.spec.proposer import Proposal

ARTIFACT_DIR = Path(__file__).resolve().parent.parent / "artifacts" / "self_spec"
DRAFT_DIR = ARTIFACT_DIR.parent / "draft"  # the small draft: an adapter with L = 0 (``leapdecode train draft``)
EAGLE_DIR = ARTIFACT_DIR.parent / "eagle"  # the feature-conditioned draft (``leapdecode train draft --features``)
# per kind of drafter, the command that trains one (its shipped artefact: shipped_dir)
TRAIN_COMMANDS = {"self_spec": "train self-spec", "draft_model": "train draft", "eagle": "train draft --features"}
WEIGHTS_FILE = "adapter.safetensors"
CONFIG_FILE = "config.json"
RECORD_FILE = "record.json"
ARTIFACT_TYPE = "leapdecode.self_spec.exit_adapter"
DEFAULT_MIN_DRAFT_PROB = 0.3
DRAFT_PRECISIONS = ("int8", "float32")  # the drafter's own weights and activations on a CPU (see __init__)
DEFAULT_DRAFT_PRECISION = "int8"
# the target's architecture fields an adapter must match to run on it
ARCH_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size")


def shipped_dir(kind: str) -> Path:
    """Where the shipped artefact of ``kind`` lives (looked up on each call, so tests can point it elsewhere)."""
    return {"self_spec": ARTIFACT_DIR, "draft_model": DRAFT_DIR, "eagle": EAGLE_DIR}[kind]


# ------------------------------------------------------------------------------------------------ the adapter
class ExitAdapter(nn.Module):
    """``num_layers`` decoder layers (the target's architecture) and an RMSNorm: ``h_L -> norm(layers(h_L))``, fed
    to the target's LM head. ``layer_index`` is L, the number of target layers the drafter shares. L = 0 makes it a
    small draft model of its own that shares only the target's embedding and LM head (``draft_model`` without a
    path; brief: a draft with <= 1/10 of the target's non-embedding parameters is 3 of SmolLM2's 30 layers).

    ``feature_input`` (L = 0 only) makes it a *feature-conditioned* draft (EAGLE-style): its input at position p
    is ``fc([f_{p-1}, embed(x_p)])``, where ``f_{p-1}`` is the target's final normed hidden state one position
    back (what the target's LM head read to pick x_p) for committed tokens and the draft's own output while it
    drafts. Knowing both the target's last feature and the token actually chosen from it lets one layer agree with
    the target more often than three layers that see tokens only (38% vs 31-34% held-out on SmolLM2), at half
    the draft-step cost (FeatureDraftProposer)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, num_layers: int = 1, feature_input: bool = False) -> None:
        super().__init__()
        if not 0 <= layer_index < cfg.num_hidden_layers:
            raise ValueError(f"the exit layer L must be in [0, {cfg.num_hidden_layers - 1}], got {layer_index}")
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"an adapter has 1 to {cfg.num_hidden_layers} layers, got {num_layers}")
        if feature_input and layer_index:
            raise ValueError("a feature-conditioned draft shares no target layers (L = 0)")
        self.config = cfg
        self.layer_index = layer_index
        self.feature_input = feature_input
        # [f_{p-1}, embed(x_p)] -> H; replicated under tensor parallelism (0.66M parameters on SmolLM2)
        self.fc = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size) if feature_input else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def fuse(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """A feature draft's input rows: ``features`` are f_{p-1} (zeros at position 0), ``embeds`` embed(x_p)."""
        assert self.fc is not None, "only feature-conditioned drafts fuse features"
        return self.fc(torch.cat([features.to(embeds.dtype), embeds], dim=-1))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(
        self,
        h: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Inference over a flat batch and the adapter's own paged cache (one entry of ``kv`` per layer; the
        same kernels as the target)."""
        for layer, layer_kv in zip(self.layers, kv, strict=True):
            h = layer(h, rope, layer_kv, meta)
        return self.norm(h)

    def forward_dense(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Differentiable training forward: ``h`` [B, T, H] right-padded sequences starting at position 0, plain
        causal attention (padding sits after every real token, so it is never attended to). Matches
        :meth:`forward` numerically; tests check it."""
        for layer in self.layers:
            h = _dense_layer(layer, h, rope)
        return self.norm(h)

    @classmethod
    def from_target(cls, target: LlamaForCausalLM, layer_index: int, init: str = "next",
                    num_layers: int = 1, feature_input: bool = False) -> ExitAdapter:
        """Start from target layers so training begins near a working exit: ``next`` copies layers L .. L+N-1
        (the layers that read h_L in the target), ``last`` the target's last N layers (which feed the final norm
        and head); the norm always starts as the target's final norm. A feature draft's ``fc`` starts as
        "the embedding only" ([0 | I]), i.e. as the plain draft with the same layers."""
        cfg = target.config
        adapter = cls(cfg, layer_index, num_layers, feature_input)
        p = next(target.parameters())
        adapter.to(device=p.device, dtype=p.dtype)
        first = {"next": layer_index, "last": cfg.num_hidden_layers - num_layers}.get(init)
        if first is None:
            raise ValueError(f"unknown adapter init {init!r}; choose next or last")
        if first + num_layers > cfg.num_hidden_layers:
            raise ValueError(f"init {init!r} needs target layers {first}..{first + num_layers - 1}, the target has "
                             f"{cfg.num_hidden_layers}")
        with torch.no_grad():
            for i, layer in enumerate(adapter.layers):
                layer.load_state_dict(target.layers[first + i].state_dict())
            adapter.norm.weight.copy_(target.norm.weight)
            if adapter.fc is not None:
                h = cfg.hidden_size
                adapter.fc.weight.zero_()
                adapter.fc.weight[:, h:].copy_(torch.eye(h))
        return adapter


def _dense_layer(layer: DecoderLayer, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One decoder layer over dense right-padded sequences with causal SDPA (the training path)."""
    attn = layer.self_attn
    b, t, _ = h.shape
    x = layer.input_layernorm(h)
    q, k, v = attn.qkv_proj(x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = q.view(b, t, attn.num_heads, attn.head_dim)
    k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
    v = v.view(b, t, attn.num_kv_heads, attn.head_dim)
    q, k = apply_rotary(q, k, rope)
    group = attn.num_heads // attn.num_kv_heads
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    x2 = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, attn.q_size))
    return x2 + layer.mlp(layer.post_attention_layernorm(x2))


def target_fingerprint(model: LlamaForCausalLM) -> list[float]:
    """A few norm-weight sums that identify a checkpoint (norms stay float even in quantized GGUF files, so a
    GGUF and its HF original agree); used to offer a shipped adapter only to the model it was trained on."""
    vals = [model.norm.weight, model.layers[0].input_layernorm.weight, model.layers[-1].post_attention_layernorm.weight]
    return [float(w.detach().double().sum()) for w in vals]


def _fingerprint_matches(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-3, abs_tol=1e-3) for x, y in zip(a, b))


def arch_of(cfg: ModelConfig) -> dict[str, int]:
    return {f: int(getattr(cfg, f)) for f in ARCH_FIELDS}


def save_adapter(adapter: ExitAdapter, folder: str | Path, target: LlamaForCausalLM, extra: dict[str, Any],
                 vocab_ranked: torch.Tensor | None = None) -> Path:
    """Write ``adapter.safetensors`` (weights in the engine's fused layout, plus the frequency-ranked vocabulary
    if given) and ``config.json``; returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in adapter.state_dict().items()}
    if vocab_ranked is not None:
        tensors["vocab_ranked"] = vocab_ranked.to("cpu", torch.int64).contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    config = {
        "type": ARTIFACT_TYPE,
        "layer": adapter.layer_index,
        "num_layers": adapter.num_layers,
        "input": "features" if adapter.feature_input else "hidden",
        "arch": arch_of(adapter.config),
        "target_fingerprint": target_fingerprint(target),
        **extra,
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise FileNotFoundError(
            f"{folder} is not a self_spec adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}); train one with "
            "`leapdecode train self-spec`"
        )
    cfg = json.loads(path.read_text())
    if cfg.get("type") != ARTIFACT_TYPE:
        raise ValueError(f"{path} is not a self_spec exit adapter (type {cfg.get('type')!r})")
    return cfg


def check_compatible(cfg: dict[str, Any], target: LlamaForCausalLM) -> None:
    want, have = cfg["arch"], arch_of(target.config)
    diff = {k: (want.get(k), v) for k, v in have.items() if want.get(k) != v}
    if diff:
        raise ValueError(
            "this self_spec adapter was trained for another model architecture "
            + ", ".join(f"{k}: adapter {a} vs target {b}" for k, (a, b) in diff.items())
        )


def load_adapter(
    folder: str | Path, target: LlamaForCausalLM
) -> tuple[ExitAdapter, dict[str, Any], torch.Tensor | None]:
    """The adapter on the target's device and dtype, its config, and the ranked vocabulary (or None)."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(folder)
    check_compatible(cfg, target)
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    ranked = tensors.pop("vocab_ranked", None)
    # one-layer adapters written before adapters could have several layers named it "layer"
    tensors = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v for k, v in tensors.items()}
    adapter = ExitAdapter(target.config, int(cfg["layer"]), int(cfg.get("num_layers", 1)),
                          feature_input=cfg.get("input") == "features")
    p = next(target.parameters())
    adapter.to(device=p.device, dtype=p.dtype)
    params = dict(adapter.named_parameters())
    missing = set(params) - set(tensors)
    if missing:
        raise ValueError(f"{folder}/{WEIGHTS_FILE} lacks {sorted(missing)}")
    with torch.no_grad():
        for name, prm in params.items():
            full = tensors[name]
            prm.copy_(shard_tensor(full, getattr(prm, "shard_dim", None), getattr(prm, "shard_parts", None)))
    return adapter.eval(), cfg, ranked


def shipped_adapter_path(folder: Path | None = None) -> Path | None:
    """The default adapter shipped in the package (``leapdecode/artifacts/self_spec/``, or ``folder``, e.g. the
    small draft in ``artifacts/draft/``), if present."""
    folder = ARTIFACT_DIR if folder is None else folder
    return folder if (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file() else None


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a drafter written by ``leapdecode train self-spec`` / ``train draft``."""
    try:
        read_adapter_config(path)
        return True
    except (FileNotFoundError, ValueError, OSError):
        return False


def shipped_adapter_for(target: LlamaForCausalLM, folder: Path | None = None) -> Path | None:
    """The shipped adapter (or the drafter in ``folder``) when it was trained for this very target (architecture
    and fingerprint), else None; ``auto`` only offers it then."""
    path = shipped_adapter_path(folder)
    if path is None:
        return None
    try:
        cfg = read_adapter_config(path)
        check_compatible(cfg, target)
    except (ValueError, FileNotFoundError, KeyError):
        return None
    return path if _fingerprint_matches(cfg.get("target_fingerprint", []), target_fingerprint(target)) else None


# ----------------------------------------------------------------------------------------------- the drafter
def _with_probs(props: list[Proposal], probs_rows: dict[int, list[torch.Tensor]]) -> list[Proposal]:
    """Attach each sampled chain's draft distributions (rows in draft order) to its proposal."""
    for i, rows in probs_rows.items():
        if rows:
            props[i].probs = torch.stack(rows)
    return props


@dataclasses.dataclass
class _Plan:
    """One sequence's drafting this step."""

    index: int  # into the propose() arguments
    seq: Sequence
    shadow: _Shadow  # adapter cache: block table and how many leading positions have adapter K/V
    budget: int
    catchup: torch.Tensor  # [m, H] rows the adapter has not seen of committed positions (_catchup_for)


class SelfSpecProposer(ShadowCacheProposer):
    """Drafts with target layers [0, L) (writing the target's own cache slots beyond the committed length), the
    exit adapter (its own paged cache) and the target's LM head. See the module docstring."""

    name = "self_spec"

    def __init__(self, engine, adapter: ExitAdapter, min_draft_prob: float = DEFAULT_MIN_DRAFT_PROB,
                 vocab_subset: torch.Tensor | None = None, draft_precision: str = DEFAULT_DRAFT_PRECISION) -> None:
        self.engine = engine
        self.model: LlamaForCausalLM = engine.model
        self.adapter = adapter
        self.num_shared_layers = adapter.layer_index
        self.min_draft_prob = float(min_draft_prob)
        cfg = self.model.config
        bs = engine.config.block_size
        num_blocks = engine.block_manager.num_blocks
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.target_runner: ModelRunner = engine.runner
        self.target_kv: KVCache = engine.kv_cache
        # the adapter's own paged cache (its layers only); as many blocks as the target, which is enough for every
        # running sequence (adapter positions never exceed the target's)
        adapter_cfg = dataclasses.replace(cfg, num_hidden_layers=adapter.num_layers)
        self.adapter_kv = KVCache(adapter_cfg, num_blocks, bs, self.dtype, self.device)
        self.adapter_bm = self.shadow_bm = BlockManager(num_blocks, bs, enable_prefix_caching=False)
        self.adapter_runner = ModelRunner(self.model, self.adapter_kv, bs, self.device)  # for prepare() only
        self.shadows: dict[str, _Shadow] = {}
        # h_L of every target pass, filed by target KV slot, with the (position, token) each row belongs to
        slots = num_blocks * bs
        self.h_pool = torch.zeros(slots, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.pos_tag = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.tok_tag = torch.full((slots,), -1, dtype=torch.long, device=self.device)
        self.target_runner.add_capture(self.capture_layer(), self._capture, self._copy_slots)
        self.vocab_subset = None if vocab_subset is None else vocab_subset.to(self.device, torch.long)
        self._head_subset: torch.Tensor | None = None
        self._head_subset_packed: torch.Tensor | None = None
        if self.vocab_subset is not None:
            self._head_subset = self.model.lm_head.get_weight().index_select(0, self.vocab_subset)
        # the adapter and a subset head through the engine's few-row kernel, as the target's own layers: unpacked,
        # the adapter alone read 14 MB of float32 weights per draft step through torch's ops. "int8" (default on
        # a CPU): Q8_0 weights and int8 activations, a quarter of the bytes on VNNI or AVX2 (small_gemm.
        # enable_int8_drafting); the target verifies every token, so precision moves acceptance, not output
        if draft_precision not in DRAFT_PRECISIONS:
            raise ValueError(f"draft_precision must be one of {DRAFT_PRECISIONS}, got {draft_precision!r}")
        packed = engine.pack_linears(adapter, quantize_q8=draft_precision == "int8")
        # int8 only where the engine packs at all (a CPU float32 model with the kernel); else the weights stay float
        int8 = bool(getattr(adapter, "int8_activations", False))
        if packed and self._head_subset is not None:
            self._head_subset_packed = small_gemm.pack_rows(self.model.lm_head, self.vocab_subset, self._head_subset,
                                                            int8_activations=int8)
        self.draft_precision = "int8" if int8 else "float32"
        # counters (see the module docstring)
        self.num_shared_tokens = 0
        self.num_shared_calls = 0
        self.num_adapter_tokens = 0
        self.num_catchup_tokens = 0
        self.num_fallback_tokens = 0
        self.num_captured_tokens = 0

    def capture_layer(self) -> int:
        """After which target layer the runner hands this drafter its hidden states (h_L)."""
        return self.num_shared_layers

    @classmethod
    def from_config(cls, cfg, engine, shipped_only: bool = False, kind: str = "self_spec") -> SelfSpecProposer:
        """``cfg.model`` is an adapter folder; without one (or with ``shipped_only``, as under ``auto``, where
        "model" names a draft model), the shipped one of ``kind`` (``shipped_dir``): the exit adapter, the small draft
        (an adapter with no shared layers, ``draft_model``) or the feature-conditioned draft (``eagle``). A
        ``draft_model`` folder may hold either kind of draft; ``eagle`` must be a feature draft. Extra keys:
        ``min_draft_prob`` (stop drafting below this top probability), ``draft_vocab`` (score only the N most
        frequent tokens of the artefact's ranked vocabulary; 0 = the full LM head), ``draft_precision`` ("int8"
        or "float32", see ``__init__``) and, for ``eagle`` only, the dynamic-tree keys (spec/feature_draft.py)."""
        user_path = None if shipped_only else cfg.model
        folder, command = shipped_dir(kind), TRAIN_COMMANDS[kind]
        path = user_path or shipped_adapter_path(folder)
        if path is None:
            raise ValueError(
                f'speculative method "{kind}" needs a trained drafter: pass "model": PATH (a folder written by '
                f"`leapdecode {command}`); none is shipped in {folder}"
            )
        if user_path is None and shipped_adapter_for(engine.model, folder) is None:
            raise ValueError(f'speculative method "{kind}" needs "model": PATH for this model: the shipped drafter '
                             f"({path}) was trained for another one (`leapdecode {command}` makes one)")
        adapter, acfg, ranked = load_adapter(path, engine.model)
        if kind == "eagle" and not adapter.feature_input:
            raise ValueError(f'speculative method "eagle" needs a feature-conditioned draft (`leapdecode {command}`); '
                             f"{path} reads {'h_L' if adapter.layer_index else 'tokens only'}")
        extra = cfg.extra or {}
        min_p = extra.get("min_draft_prob", acfg.get("min_draft_prob", DEFAULT_MIN_DRAFT_PROB))
        if not (isinstance(min_p, (int, float)) and 0.0 <= float(min_p) <= 1.0):
            raise ValueError(f"min_draft_prob must be a number in [0, 1], got {min_p!r}")
        draft_vocab = int(extra.get("draft_vocab", acfg.get("draft_vocab", 0)) or 0)
        subset = None
        if draft_vocab:
            if ranked is None:
                raise ValueError(f"draft_vocab={draft_vocab} needs a ranked vocabulary, and {path} has none")
            subset = ranked[:draft_vocab]
        from leapdecode.spec.feature_draft import TREE_KEYS, FeatureDraftProposer

        if adapter.feature_input:  # an EAGLE-style draft: it reads the target's features (spec/feature_draft.py)
            cls = FeatureDraftProposer
        prop = cls(engine, adapter, float(min_p), subset, extra.get("draft_precision", DEFAULT_DRAFT_PRECISION))
        tree_keys = sorted(k for k in extra if k in TREE_KEYS)
        if tree_keys and cfg.method in ("self_spec", "draft_model"):
            raise ValueError(f"{', '.join(tree_keys)}: a dynamic draft tree needs the eagle method")
        if cfg.method == "eagle":  # not under auto (Medusa owns tree_nodes there); a hybrid trunk gets no tree_ keys
            prop.configure_tree(extra)  # type: ignore[attr-defined]
        val = acfg.get("validation") or {}
        # drafting stops below min_draft_prob, so a drafted token's acceptance is the agreement where the draft is
        # that confident (valid when the threshold is the one the artefact was validated at)
        key = "agree_confident" if float(min_p) == float(acfg.get("min_draft_prob", -1)) and min_p > 0 else "agree"
        if subset is not None:  # validated only for the training loss's subset (it can agree more: no rare tokens)
            key = "agree_subset_head" if draft_vocab == acfg.get("loss_vocab") else ""
        if isinstance(val.get(key), (int, float)):
            prop.prior_acceptance = float(val[key])
        return prop

    def detach(self) -> None:
        """Stop capturing the target's hidden states (``auto`` dropped this drafter); frees the hidden pool."""
        self.target_runner.remove_capture(self._capture)
        self.h_pool = self.h_pool.new_zeros(0, self.h_pool.shape[1])

    # ------------------------------------------------------------------------------------ target capture
    def _capture(self, h: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Called by the target's runner after layer L-1 of every full pass: keep h_L by slot, tagged."""
        self.h_pool.index_copy_(0, slot_mapping, h.to(self.dtype))
        self.pos_tag.index_copy_(0, slot_mapping, positions)
        self.tok_tag.index_copy_(0, slot_mapping, input_ids)
        self.num_captured_tokens += int(h.shape[0])

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The engine moved K/V (tree compaction): the hidden states and tags filed at those slots move along."""
        if self.h_pool.shape[0]:
            for t in (self.h_pool, self.pos_tag, self.tok_tag):
                t.index_copy_(0, dst, t.index_select(0, src))

    def _slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        bs = self.engine.config.block_size
        p = torch.arange(start, end)
        return (torch.tensor(table, dtype=torch.long)[p // bs] * bs + p % bs).to(self.device)

    def _catchup_rows(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """h_L of committed positions [start, end) from the target's passes; positions whose tag does not match
        (a tree method moved their K/V) are recomputed from the first mismatch on (the fallback)."""
        if end <= start:
            return self.h_pool.new_zeros(0, self.h_pool.shape[1])
        slots = self._slots(seq.block_table, start, end)
        want_pos = torch.arange(start, end, device=self.device)
        want_tok = torch.tensor(seq.token_ids[start:end], dtype=torch.long, device=self.device)
        ok = (self.pos_tag[slots] == want_pos) & (self.tok_tag[slots] == want_tok)
        rows = self.h_pool[slots]
        if bool(ok.all()):
            return rows
        first = int((~ok).nonzero()[0, 0])
        fresh = self._recompute_shared(seq, start + first, end)
        return torch.cat([rows[:first], fresh])

    # -------------------------------------------------------------------------------------------- passes
    def _shared(self, items: list[ForwardItem], scratch_slot: int | None = None) -> torch.Tensor:
        """Target layers [0, L) over ``items`` (flat rows, un-normed h_L). K/V go to the items' slots in the
        target cache, or all to ``scratch_slot`` when given (the fallback must not rewrite committed K/V)."""
        ids, pos, meta, _ = self.target_runner.prepare(items)
        if scratch_slot is not None:
            meta.slot_mapping = torch.full_like(meta.slot_mapping, scratch_slot)
        h = self.model(ids, pos, self.target_kv.layers, meta, layers=range(self.num_shared_layers),
                       final_norm=False)
        self.num_shared_calls += 1
        self.num_shared_tokens += int(ids.numel())
        return h

    def _adapter_pass(self, items: list[ForwardItem], h: torch.Tensor) -> torch.Tensor:
        """The adapter over flat rows ``h`` laid out as ``items`` (adapter block tables); returns the normed
        hidden states of the items' ``logit_rows``."""
        _, pos, meta, rows = self.adapter_runner.prepare(items)
        rope = self.model.rope.table(pos, h.dtype)
        out = self.adapter(h, rope, self.adapter_kv.layers, meta)
        self.num_adapter_tokens += int(h.shape[0])
        return out.index_select(0, rows)

    def _subset_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float logits over the vocabulary subset and the token ids of its columns (None: the full vocabulary,
        ids = columns). Only the subset's rows of the LM head are scored; the other tokens are never drafted, and
        softmax, max and top-k over these columns equal those over a full width with -inf elsewhere."""
        if self._head_subset is None:
            return self.model.compute_logits(hidden).float(), None
        return small_gemm.linear(hidden, self._head_subset, None, self._head_subset_packed).float(), self.vocab_subset

    def _full_width(self, sub: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
        """Subset logits scattered into the whole vocabulary (-inf elsewhere): a sampled draft's distribution,
        which rejection sampling compares with the target's over every token."""
        if ids is None:
            return sub
        out = sub.new_full((sub.shape[0], self.model.config.vocab_size), float("-inf"))
        out[:, ids] = sub
        return out

    def _recompute_shared(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Fallback: h_L for committed positions [start, end) by running layers [0, L); attention reads the
        target's committed K/V, and this pass's own K/V go to the slot of position ``num_tokens - 1`` (not yet
        computed, written again by the draft pass and the verification)."""
        scratch = int(self._slots(seq.block_table, seq.num_tokens - 1, seq.num_tokens)[0])
        h = self._shared([ForwardItem(seq.block_table, start, seq.token_ids[start:end], [])], scratch_slot=scratch)
        self.num_fallback_tokens += end - start
        return h

    # ------------------------------------------------------------------------------------------ proposing
    def _reserve(self, sh: _Shadow, num_tokens: int) -> bool:
        """Adapter blocks for ``num_tokens`` positions; frees the shadows of sequences no longer running
        (preempted ones rebuild theirs from the target's hidden states) when the pool is short."""
        if not self.adapter_bm.can_allocate(sh, num_tokens):  # type: ignore[arg-type]
            running = {s.request_id for s in self.engine.scheduler.running}
            for rid in [r for r, s in self.shadows.items() if r not in running and s is not sh]:
                self.adapter_bm.free(self.shadows.pop(rid))  # type: ignore[arg-type]
            if not self.adapter_bm.can_allocate(sh, num_tokens):  # type: ignore[arg-type]
                return False
        self.adapter_bm.allocate(sh, num_tokens)  # type: ignore[arg-type]
        return True

    def _plan(self, seqs: list[Sequence], budgets: list[int]) -> list[_Plan]:
        """The decoding sequences that can draft this step, each with adapter blocks reserved and its catch-up
        rows (``_catchup_for``)."""
        plans: list[_Plan] = []
        for i, (seq, k) in enumerate(zip(seqs, budgets)):
            n = seq.num_tokens
            k = min(k, self.engine.max_model_len - n)
            # only decoding sequences: the target's cache holds every token but the last
            if k <= 0 or seq.num_computed_tokens != n - 1:
                continue
            sh = self.shadows.setdefault(seq.request_id, _Shadow())
            if sh.num_computed_tokens > n - 1:  # defensive: never trust adapter K/V past the committed prefix
                sh.num_computed_tokens = n - 1
            # the adapter writes positions a .. n+k-2 (the last committed token and all drafts but the last)
            if not self._reserve(sh, n + k - 1):
                continue
            plans.append(_Plan(i, seq, sh, k, self._catchup_for(seq, sh.num_computed_tokens)))
        return plans

    def _catchup_for(self, seq: Sequence, start: int) -> torch.Tensor:
        """What the adapter must see of committed positions [start, n-1) before it drafts: their h_L."""
        return self._catchup_rows(seq, start, seq.num_tokens - 1)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        plans = self._plan(seqs, budgets)
        if not plans:
            return props
        probs_rows: dict[int, list[torch.Tensor]] = {p.index: [] for p in plans}
        # step 0 feeds each sequence's last committed token; later steps feed the previous draft
        feed = [p.seq.token_ids[-1] for p in plans]
        active = plans
        step = 0
        while active:
            shared_items = [ForwardItem(p.seq.block_table, p.seq.num_tokens - 1 + step, [tok], [0])
                            for p, tok in zip(active, feed)]
            h_new = self._shared(shared_items)
            if step == 0:
                parts: list[torch.Tensor] = []
                adapter_items: list[ForwardItem] = []
                for j, p in enumerate(active):
                    a = p.shadow.num_computed_tokens
                    m = p.catchup.shape[0]
                    self.num_catchup_tokens += m
                    parts += [p.catchup, h_new[j : j + 1]]
                    adapter_items.append(ForwardItem(p.shadow.block_table, a, [0] * (m + 1), [m]))
                h_in = torch.cat(parts)
            else:
                adapter_items = [ForwardItem(p.shadow.block_table, p.shadow.num_computed_tokens, [0], [0])
                                 for p in active]
                h_in = h_new
            logits = self._subset_logits(self._adapter_pass(adapter_items, h_in))
            keep, feed = self._draft_step(active, adapter_items, logits, props, probs_rows)
            active = [active[j] for j in keep]
            step += 1
        return _with_probs(props, probs_rows)

    def _draft_step(self, active: list[_Plan], items: list[ForwardItem],
                    logits: tuple[torch.Tensor, torch.Tensor | None], props: list[Proposal],
                    probs_rows: dict[int, list[torch.Tensor]]) -> tuple[list[int], list[int]]:
        """One draft position for every active chain (row j of the ``_subset_logits`` pair is chain j's): its
        adapter cache now covers ``items``; a chain whose top probability is below ``min_draft_prob`` stops, the
        others draft their argmax (or sample it, keeping the distribution for rejection sampling). Returns the
        indices into ``active`` of the chains that go on and the tokens they drafted."""
        sub, ids = logits
        best = torch.softmax(sub, dim=-1).max(dim=-1)
        top = best.values.tolist()
        argmax = (best.indices if ids is None else ids[best.indices]).tolist()
        keep, toks = [], []
        for j, (p, it) in enumerate(zip(active, items)):
            p.shadow.num_computed_tokens = it.start + len(it.tokens)
            seq = p.seq
            if top[j] < self.min_draft_prob:
                continue  # not confident enough: stop this chain here
            if seq.params.greedy or self.argmax_drafts:
                tok = argmax[j]
            else:
                q = processed_probs(self._full_width(sub[j : j + 1], ids), [seq.params])[0]
                tok = sample_from(q, seq.generator or self.engine.generator)
                probs_rows[p.index].append(q)
            props[p.index].tokens.append(tok)
            if len(props[p.index].tokens) < p.budget:
                keep.append(j)
                toks.append(tok)
        return keep, toks

    # on_verified / release (ShadowCacheProposer) roll the adapter cache back to the committed prefix; accepted
    # drafts keep the adapter K/V written while drafting (their h_L equals the target's): nothing is recomputed

    # ------------------------------------------------------------------------------------------------ cost
    @torch.inference_mode()
    def _timed_draft_step(self, n: int) -> None:
        """One draft step of ``n`` rows at a short context on borrowed scratch blocks (returned), for the cost
        model; it bypasses the capture so h_pool is untouched."""
        ctx = 64
        bm, abm = self.engine.block_manager, self.adapter_bm
        if any(m.blocks_needed(ctx + n) > m.num_free_blocks for m in (bm, abm)):
            return
        counters = (self.num_shared_tokens, self.num_shared_calls, self.num_adapter_tokens)
        try:
            with bm.borrowed(ctx + n) as target_table, abm.borrowed(ctx + n) as adapter_table:
                h = self._shared([ForwardItem(target_table, ctx, [0] * n, [])])
                out = self._adapter_pass([ForwardItem(adapter_table, ctx, [0] * n, list(range(n)))], h)
                torch.softmax(self._subset_logits(out)[0], dim=-1).max(dim=-1)
        finally:
            self.num_shared_tokens, self.num_shared_calls, self.num_adapter_tokens = counters
