"""The decoder every supported family runs as (models/config.py): Llama 1-3 and SmolLM, Mistral with its sliding
window, Qwen2 (QKV bias), Qwen3 (q/k norms), Phi-3, Gemma 3 (q/k norms, norms around each block, GeGLU, scaled
embeddings, local and global layers with their own RoPE bases). The class keeps the Llama name because the layout
is Llama's; ``ModelConfig`` switches the parts that differ.

Plain PyTorch, device-agnostic, flat-batch (varlen) forward over the paged KV cache. Projections are fused
(QKV in one matmul, gate+up in one) because a decode step on CPU is bound by weight reads and per-op overhead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from leapdecode.layers import decoder_stack, int8_kv, layer_ops, small_gemm
from leapdecode.layers.attention import ROWS_KERNEL_DTYPES, AttentionMetadata, paged_attention
from leapdecode.layers.kv_quant import QuantizedKV
from leapdecode.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from leapdecode.layers.rotary import RotaryEmbedding, rotate
from leapdecode.models.config import ModelConfig
from leapdecode.parallel import divide, kv_head_range, tp_size


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.weight.shard_dim, self.weight.shard_parts = None, None
        self.use_kernel = False  # set by kernel_plan.apply_plan: one C++ call instead of torch's five ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel:
            return layer_ops.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        d = cfg.head_dim
        group = divide(cfg.num_attention_heads, cfg.num_key_value_heads, "num_attention_heads / KV heads")
        first_kv, self.num_kv_heads = kv_head_range(cfg.num_key_value_heads)  # whole KV heads per rank
        self.num_heads = self.num_kv_heads * group
        self.head_dim = d
        self.scale = cfg.query_scale if cfg.query_scale is not None else d**-0.5
        self.window = window  # sliding window of this layer (None: global)
        if cfg.qk_norm:  # per head, before RoPE
            self.q_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        q_range, kv_range = (first_kv * group * d, self.q_size), (first_kv * d, self.kv_size)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
            bias=cfg.attention_bias, ranges=[q_range, kv_range, kv_range],
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, in_range=q_range)
        self.use_kernel = False  # set by kernel_plan.apply_plan: C++ RoPE and attention for few-token rows

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t, nq, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, d)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].reshape(t, nq, d))
            k = self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].reshape(t, self.num_kv_heads, d))
            qkv = torch.cat([q, k], dim=1).view(t, -1)  # the rotated part, laid out as in the fused projection
        if self.use_kernel and qkv.dtype == torch.float32:  # the C++ RoPE in place, as in the fused layer
            layer_ops.rope_(qkv, rope[0].view(t, d), rope[1].view(t, d), nq + self.num_kv_heads)
            qk = qkv[:, : self.q_size + self.kv_size].view(t, nq + self.num_kv_heads, d)
        else:
            # q and k are adjacent in the fused projection: rotate them as one [T, heads + kv_heads, d] tensor
            qk = rotate(qkv[:, : self.q_size + self.kv_size].view(t, nq + self.num_kv_heads, d), rope)
        o = paged_attention(qk[:, :nq], qk[:, nq:], v, kv[0], kv[1], meta.for_window(self.window), self.scale,
                            self.use_kernel)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = divide(cfg.intermediate_size, tp_size(), "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size)
        self.act = cfg.hidden_act  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
        self.use_kernel = False  # set by kernel_plan.apply_plan: the activation and the product in one C++ call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.use_kernel and gate_up.dtype == torch.float32 and not gate_up.requires_grad:
            act = layer_ops.gelu_tanh_mul if self.act == "gelu_tanh" else layer_ops.silu_mul
            return self.down_proj(act(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)
        if self.act == "gelu_tanh":
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks. Llama's layout names the MLP's input norm ``post_attention_layernorm``;
    with ``sandwich_norms`` (Gemma) that norm is applied to the attention's output instead, and the MLP block has
    its own ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` (the checkpoints' names)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the one-layer C++ call (decoder_layer) computes Llama's layout with SiLU; the stack (decoder_stack) also
        # the normed layout: q/k norms, the norms around each block, GeGLU (over float or int8 caches)
        self.normed = cfg.sandwich_norms or cfg.qk_norm or cfg.hidden_act != "silu"
        self.fusable = not self.normed
        self.use_kernel = False  # set by kernel_plan.apply_plan when every part of the layer has its kernel
        self._fused_args: tuple | None = None  # the packed weights etc. for _fused, gathered on first use

    def forward(self, x, rope, kv, meta) -> torch.Tensor:
        if self.fusable and self.use_kernel and x.shape[0] <= small_gemm.MAX_ROWS and x.dtype == torch.float32:
            planes = fused_kv(kv)
            seen = meta.for_window(self.self_attn.window)
            if planes is not None and seen.all_kernel_rows():
                return self._fused(x, rope, planes, seen)
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv, meta))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused_args(self) -> tuple:
        """(weights, qkv bias, heads, KV heads, eps, scale, normed layout's 4 norms or None, windowed, GeGLU) for
        the C++ layer; gathered once (nn.Module attribute lookups cost more than the call), so the packed weights
        must not change after ``kernel_plan.apply_plan``. The weights' 4th is the MLP's input norm."""
        if self._fused_args is None:
            a, m = self.self_attn, self.mlp
            mlp_norm = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
            w = [self.input_layernorm.weight, a.qkv_proj.packed, a.o_proj.packed, mlp_norm.weight,
                 m.gate_up_proj.packed, m.down_proj.packed]
            norms = None
            if self.normed:
                outs = [self.post_attention_layernorm, self.post_feedforward_layernorm] if self.sandwich else [None] * 2
                norms = [None if n is None else n.weight for n in (a.q_norm, a.k_norm, *outs)]
            self._fused_args = (w, a.qkv_proj.bias, a.num_heads, a.num_kv_heads, self.input_layernorm.eps, a.scale,
                                norms, a.window is not None, m.act == "gelu_tanh")
        return self._fused_args

    def _fused(self, x, rope, planes: tuple[list[torch.Tensor], list[torch.Tensor]], meta) -> torch.Tensor:
        """The same layer in one C++ call (kernels/decoder_stack.cpp) for steps made only of few-token rows: the
        same kernels as the per-op path, so bitwise the same result, without ~10 Python-level calls. ``planes``
        is :func:`fused_kv` of the layer's cache; ``meta`` the step as this layer's window sees it."""
        w, bias, heads, kv_heads, eps, scale = self.fused_args()[:6]
        caches, transforms = planes
        t = x.shape[0]
        if transforms:  # int8 planes
            return decoder_stack.decoder_layer_i8(x.contiguous(), w, bias, rope[0].view(t, -1), rope[1].view(t, -1),
                                               caches, transforms, meta.slot_mapping, *meta.kernel_rows(), heads,
                                               kv_heads, eps, scale)  # fmt: skip
        return decoder_stack.decoder_layer(x.contiguous(), w, bias, rope[0].view(t, -1), rope[1].view(t, -1), *caches,
                                        meta.slot_mapping, *meta.kernel_rows(), heads, kv_heads, eps, scale)


def fused_kv(kv) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """One layer's KV cache as the C++ layer takes it, or None when that layer must run op by op: a float32,
    bfloat16 or float16 cache is ``([K, V], [])``; an int8 cache the C++ ops serve, once it no longer observes keys
    for calibration, is its four planes ``[k data, k scales, v data, v scales]`` and five transforms ``[k shift,
    k smooth, k rotation, v rotation, v rotation transposed]`` (empty = identity). Shared by the per-layer call and
    the whole-stack call, so both take the fused path for exactly the same caches."""
    k, v = kv
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
        return ([k, v], []) if k.dtype == v.dtype and k.dtype in ROWS_KERNEL_DTYPES else None
    if not (isinstance(k, QuantizedKV) and isinstance(v, QuantizedKV) and k.observed is None
            and int8_kv.int8_kv_kernels(k)):
        return None
    empty = k.scale.new_empty(0, dtype=torch.float32)
    transforms = [empty if a is None else a.contiguous()
                  for a in (k.shift, k.smooth, k.rotation, v.rotation, v.rotation_t)]
    return [k.data, k.scale, v.data, v.scale], transforms


class LlamaForCausalLM(nn.Module):
    """``forward`` returns final hidden states for all flat rows; ``compute_logits`` projects only the rows asked
    for (sampling positions), since the 49k-wide LM head is a large share of a small model's step."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.layer_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, tied_to=self.embed_tokens if cfg.tie_word_embeddings else None
        )
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        # Gemma 3's windowed layers rotate with their own base (and without the global layers' scaling)
        self.local_rope = None
        if cfg.local_rope_theta is not None and (cfg.local_rope_theta != cfg.rope_theta or cfg.rope_scaling):
            self.local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta, None)
        # per run of layers: its DecoderLayers, their attention windows and, once packed, their flattened C++
        # arguments (_layer_stack)
        self._stack_weights: dict[tuple[int, int], tuple[list[DecoderLayer], set[int | None],
                                                          decoder_stack.StackWeights | None]] = {}

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layers: range | None = None,
        hidden: torch.Tensor | None = None,
        final_norm: bool = True,
    ) -> torch.Tensor:
        """Run ``layers`` (default: all) on embeddings of ``input_ids`` (or on ``hidden`` if given).

        Running a prefix of the layers is how self-speculation drafts with the target's own first layers.
        """
        x = self.embed(input_ids) if hidden is None else hidden
        rope = self.rope.table(positions, x.dtype)
        local = rope if self.local_rope is None else self.local_rope.table(positions, x.dtype)
        run = layers if layers is not None else range(len(self.layers))
        stack = self._layer_stack(x, kv_caches, meta, run)
        if stack is not None:  # every layer in one C++ call: the same routines as the loop below, same bits
            t = x.shape[0]
            ropes = [rope[0].view(t, -1), rope[1].view(t, -1), local[0].view(t, -1), local[1].view(t, -1)]
            global_rows = meta.kernel_rows() if not all(stack.weights.windowed) else ()
            local_rows = meta.for_window(stack.window).kernel_rows() if stack.window is not None else ()
            x = decoder_stack.decoder_stack(x.contiguous(), stack, ropes, meta.slot_mapping,
                                         [*(global_rows or local_rows), *(local_rows or global_rows)])
        else:
            for i in run:
                layer = self.layers[i]
                x = layer(x, rope if layer.self_attn.window is None else local, kv_caches[i], meta)
        return self.norm(x) if final_norm else x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings (times the family's scale, Gemma's sqrt(hidden_size), rounded as HF rounds it)."""
        x = self.embed_tokens(input_ids)
        scale = self.config.embed_scale
        return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)

    def _layer_stack(self, x: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                     run: range) -> decoder_stack.LayerStack | None:
        """The arguments for running layers ``run`` in one C++ call (``decoder_stack.decoder_stack``), or None when
        some layer of this step would not take the fused path (see ``DecoderLayer.forward``): a prefill chunk or
        split-KV rows, a layer without packed weights or with hooks, or a cache :func:`fused_kv` turns down.
        Weights are gathered once per run of layers; the caches are listed each step (cheap), so no cache outlives
        its engine through here."""
        if not (len(run) and run.step == 1 and x.shape[0] <= small_gemm.MAX_ROWS and x.dtype == torch.float32):
            return None
        key = (run.start, run.stop)
        if key not in self._stack_weights:  # the layers and their windows are fixed once the model is built
            layers = [self.layers[i] for i in run]
            self._stack_weights[key] = layers, {layer.self_attn.window for layer in layers}, None
        layers, windows, weights = self._stack_weights[key]
        if len(windows - {None}) > 1 or not all(meta.for_window(w).all_kernel_rows() for w in windows):
            return None  # two slot lists serve the layers of the call: global, and one sliding window
        if not all(layer.use_kernel and not (layer._forward_hooks or layer._forward_pre_hooks) for layer in layers):
            return None  # (a layer with hooks must be called as a module, or its hooks would not run)
        if weights is None:  # gathered once every layer has its packed weights (kernel_plan.apply_plan)
            weights = decoder_stack.stack_weights([layer.fused_args() for layer in layers])
            self._stack_weights[key] = layers, windows, weights
        planes = [fused_kv(kv_caches[i]) for i in run]
        if any(p is None for p in planes) or len({bool(p[1]) for p in planes}) != 1:  # type: ignore[index]
            return None  # a layer that must run op by op, or float32 and int8 layers mixed
        return decoder_stack.LayerStack(weights, [c for p in planes for c in p[0]],  # type: ignore[index]
                                     [t for p in planes for t in p[1]],  # type: ignore[index]
                                     next(iter(windows - {None}), None))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
