"""
A Qwen3-style transformer (MoE or dense) that matches Hugging Face transformers to fp32 rounding.

    from model import load_hf_checkpoint, save_hf_checkpoint
    model = load_hf_checkpoint("path/to/hf_dir")                   # qwen3_moe or qwen3, fp32 on cpu by default
    logits, aux_loss = model(tokens, position_ids, cu_seqlens)     # a packed batch: [T], [T], [N+1] int32
    save_hf_checkpoint(model, "out/hf")                            # AutoModelForCausalLM loads it back

Everything is computed over a *packed* batch: the sequences are laid end to end in one row of T tokens and
`cu_seqlens` marks where each one starts, so there is no padding and no attention across documents. How
attention reads keys and values is a small object handed to the forward (`attention=`): training uses
`DocumentCausalAttention` below; the inference engine hands in a paged one that reads a KV cache.

Semantics follow transformers' modeling_qwen3_moe.py line by line where it matters for the numbers:
RMSNorm in fp32, per-head q/k RMSNorm before RoPE, half-split RoPE, GQA, router softmax (fp32) then top-k,
renormalised only when `norm_topk_prob`, SwiGLU experts, dense MLP layers where `mlp_only_layers` /
`decoder_sparse_step` say so, the Switch-style load-balancing loss.
"""

import json
import math
import os
from dataclasses import dataclass, asdict, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# -----------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384           # the dense MLP's width (dense layers and dense models)
    moe_intermediate_size: int = 128       # each expert's width
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32                     # not hidden_size // heads in general: read it from the checkpoint
    num_experts: int = 8                   # 0 = a dense model (Qwen3)
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        # a frozen dataclass still needs normalising: json gives lists, we want hashable tuples
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "decoder_sparse_step"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for half-split RoPE")

    def is_moe_layer(self, i):
        # the same rule as transformers' Qwen3MoeDecoderLayer
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def model_type(self):
        return "qwen3_moe" if self.num_experts > 0 else "qwen3"

    @classmethod
    def from_hf_dict(cls, d):
        """A transformers config.json (qwen3_moe or qwen3) -> ModelConfig. Unsupported variants are refused."""
        model_type = d.get("model_type")
        if model_type not in ("qwen3_moe", "qwen3"):
            raise ValueError(f"unsupported model_type {model_type!r}: expected 'qwen3_moe' or 'qwen3'")
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported (full attention only)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (default RoPE only)")
        rope_theta = d.get("rope_theta", rope.get("rope_theta", 10000.0))
        is_moe = model_type == "qwen3_moe"
        num_experts = d.get("num_experts", d.get("num_local_experts", 0)) if is_moe else 0
        eos = d.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
            moe_intermediate_size=d.get("moe_intermediate_size", 0) if is_moe else 0,
            num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
            head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
            num_experts=num_experts, num_experts_per_tok=d.get("num_experts_per_tok", 1) if is_moe else 1,
            norm_topk_prob=d.get("norm_topk_prob", False), decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers", ())), rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta), tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", False),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self):
        """ModelConfig -> a config.json that transformers reads (built by transformers' own config class)."""
        from transformers import Qwen3Config, Qwen3MoeConfig
        kw = {k: v for k, v in asdict(self).items() if k not in ("num_experts",)}
        kw["mlp_only_layers"] = list(self.mlp_only_layers)
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta")}
        if self.num_experts > 0:
            hf = Qwen3MoeConfig(num_experts=self.num_experts, **kw)
            hf.architectures = ["Qwen3MoeForCausalLM"]
        else:
            for k in ("moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step",
                      "mlp_only_layers", "router_aux_loss_coef"):
                kw.pop(k)
            hf = Qwen3Config(**kw)
            hf.architectures = ["Qwen3ForCausalLM"]
        return hf.to_dict()


# -----------------------------------------------------------------------------
# building blocks


def rms_norm(x, weight, eps):
    # normalise the last dim in fp32 whatever the model dtype, then scale in the model dtype (as transformers does)
    # (F.rms_norm is x * rsqrt(mean(x^2) + eps), no weight: the weight is applied after the cast)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(position_ids, head_dim, theta, dtype):
    """cos/sin tables [T, head_dim] for half-split RoPE; angles in fp32, then cast like transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=position_ids.device) / head_dim))
    freqs = position_ids.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [T, heads, head_dim]; rotate the two halves of each head (not interleaved pairs)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_head * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)   # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention):
        # q, k and v in one matmul, and q and k normalised and rotated together as one [T, n_head + n_kv_head, D]
        # tensor: the same numbers as three projections, two norms and two RoPEs, in a third of the calls (at
        # decode sizes each call costs more in overhead than in arithmetic)
        T, Hq, Hkv, D = x.shape[0], self.n_head, self.n_kv_head, self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        qkv = F.linear(x, torch.cat([p.weight for p in projs]), bias).view(T, Hq + 2 * Hkv, D)
        qk, v = qkv.split([Hq + Hkv, Hkv], dim=1)       # split, not slices: its backward is one cat, no zeros
        norm_w = torch.cat((self.q_norm.weight.expand(Hq, D), self.k_norm.weight.expand(Hkv, D)))  # per head
        qk = apply_rope(rms_norm(qk, norm_w, self.q_norm.eps), cos, sin)    # q_norm and k_norm share cfg's eps
        q, k = qk.split([Hq, Hkv], dim=1)
        y = attention(self.layer_idx, q, k, v)                    # [T, n_head, head_dim]
        return self.o_proj(y.reshape(T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """The dense SwiGLU MLP (Qwen3, and Qwen3-MoE's mlp_only layers)."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts kept fused: gate and up stacked as [E, 2I, H], down as [E, H, I]."""

    def __init__(self, num_experts, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def forward(self, x, top_idx, top_w):
        # x [T, H]; top_idx / top_w [T, k]: token t goes to experts top_idx[t] with weights top_w[t].
        # sort the T*k (token, slot) pairs by expert so each expert's tokens are one contiguous slice
        T, k = top_idx.shape
        flat = top_idx.flatten()
        order = flat.argsort(stable=True)
        xs = x.index_select(0, order // k)                   # the token of each pair, expert by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0])
        if _use_grouped_mm(x, self):
            ys = self._grouped(xs, counts)
        else:
            ys = self._loop(xs, counts.tolist())
        # back to (token, slot) order by gathering with the inverse permutation (no scatter-add: deterministic,
        # and cheaper than y[order] = ys), then each token's k outputs weighted and summed
        y = ys.index_select(0, order.argsort()).view(T, k, -1)
        return (y * top_w[..., None]).sum(dim=1)

    def _loop(self, xs, counts):
        # the readable path (and the one with gradients): one SwiGLU per expert over its slice. split / unbind
        # rather than xs[a:b] / w[e]: their backward is one cat / stack, where each slice's or index's backward
        # would write a zero tensor the size of all of xs (or of all experts' weights) per expert
        ys = []
        for x, gate_up, down in zip(xs.split(counts), self.gate_up_proj.unbind(0), self.down_proj.unbind(0)):
            if len(x):
                gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
                ys.append(F.linear(F.silu(gate) * up, down))
        return torch.cat(ys)

    def _grouped(self, xs, counts):
        # the same two matmuls for all experts in one grouped-GEMM call each (offs = where each slice ends)
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs=offs)


# torch's grouped GEMM on CPU runs forward only (no backward in torch 2.13: training takes the loop) and wants
# 16-byte row strides (hidden and expert widths multiples of 4 in fp32). Where it runs it is the default: at the
# embedded size it is ~1.3x faster than the loop on a decode step's experts (measured, 1 thread).
# GROUPED_MM = False forces the loop everywhere (the reference the tests compare against).
GROUPED_MM = hasattr(torch, "_grouped_mm")


def _use_grouped_mm(x, experts):
    # CPU fp32 inference with aligned widths; anything that needs gradients takes the loop
    weights = (experts.gate_up_proj, experts.down_proj)
    if not (GROUPED_MM and x.device.type == "cpu" and x.dtype == torch.float32):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return all(w.shape[-1] % 4 == 0 for w in weights)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)    # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x):
        router_logits = self.gate(x)                                           # [T, E]
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)            # softmax first, then top-k
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return self.experts(x, top_idx, top_w.to(x.dtype)), router_logits


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, attention):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, router_logits = self.mlp(h)
            return x + h, router_logits
        return x + self.mlp(h), None


# -----------------------------------------------------------------------------
# attention over a packed batch


class DocumentCausalAttention:
    """Causal attention within each packed document, built once per forward and shared by every layer.

    On CUDA: FlexAttention with a document-causal mask_mod (a sparse BlockMask, no padding). On CPU, where
    FlexAttention runs eagerly (it materialises the T x T scores, and has no backward), the documents are laid
    into a padded [N, H, L, D] batch and SDPA runs causally on it: padding sits after each document's last
    token, so causality alone keeps every real query off it. That is N x L^2 work instead of T^2 (on a GRPO
    batch of 128 sequences of ~30 tokens, ~100x less), same mask, same numbers."""

    def __init__(self, cu_seqlens, num_tokens, device, flex=None):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(device)
        self.flex = torch.device(device).type != "cpu" if flex is None else flex   # flex=True: the CUDA path on CPU too
        self.doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        if self.doc.numel() != num_tokens:
            raise ValueError(f"cu_seqlens covers {self.doc.numel()} tokens but the batch has {num_tokens}")
        self.num_tokens, self.device = num_tokens, device
        self.num_docs, self.max_len = len(lengths), int(lengths.max()) if len(lengths) else 0
        self.pos = torch.arange(num_tokens, device=device) - cu_seqlens[:-1].long().to(device)[self.doc]
        self._block_mask = None
        doc = self.doc

        def mask_mod(b, h, q_idx, kv_idx):   # flex wants a plain function of four indices
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
        self.mask_mod = mask_mod

    def __call__(self, layer_idx, q, k, v):
        # q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]
        if not self.flex:
            def pad(t):   # [T, H, D] -> [N, H, L, D], each document from position 0
                out = t.new_zeros(self.num_docs, self.max_len, *t.shape[1:])
                out[self.doc, self.pos] = t
                return out.transpose(1, 2)
            y = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True, enable_gqa=True)
            return y.transpose(1, 2)[self.doc, self.pos]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, H, T, D]
        if self._block_mask is None:
            self._block_mask = create_block_mask(self.mask_mod, None, None, self.num_tokens,
                                                 self.num_tokens, device=self.device)
        y = flex_attention(q, k, v, block_mask=self._block_mask, enable_gqa=True)
        return y.squeeze(0).transpose(0, 1)


# -----------------------------------------------------------------------------
# the model


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # a tied head reads the embedding matrix; an untied one has its own
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def num_active_params(self):
        """Parameters one token touches: experts count top_k / E of their weights (for FLOP estimates)."""
        cfg, n = self.config, 0
        for name, p in self.named_parameters():
            frac = cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name else 1.0
            n += p.numel() * frac
        return int(n) - self.embed_tokens.weight.numel() * (0 if cfg.tie_word_embeddings else 1)

    def forward(self, tokens, position_ids, cu_seqlens=None, attention=None, logits_indices=None, aux_loss=True):
        """tokens, position_ids: [T] (a packed batch); cu_seqlens: int32 [N+1] document boundaries.
        attention: how to attend (default: causal within each document of cu_seqlens).
        logits_indices: compute logits only at these rows (the engine wants one per sequence).
        Returns (logits [T or len(logits_indices), V], aux_loss): aux_loss is the load-balancing loss over all
        MoE layers (transformers' load_balancing_loss_func), a 0-dim tensor, 0 for a dense model; None when
        aux_loss=False (inference: the engine never needs it)."""
        if tokens.dim() != 1 or position_ids.shape != tokens.shape:
            raise ValueError(f"tokens and position_ids must be 1-D and equal in shape, got "
                             f"{tuple(tokens.shape)} and {tuple(position_ids.shape)}")
        T = tokens.shape[0]
        if attention is None:
            if cu_seqlens is None:
                cu_seqlens = torch.tensor([0, T], dtype=torch.int32)
            attention = DocumentCausalAttention(cu_seqlens, T, tokens.device)
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        router_logits = []
        for layer in self.layers:
            x, r = layer(x, cos, sin, attention)
            if r is not None:
                router_logits.append(r)
        x = self.norm(x)
        if logits_indices is not None:
            x = x[logits_indices]
        logits = F.linear(x, self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight)
        if not aux_loss:
            return logits, None
        return logits, load_balancing_loss(router_logits, self.config.num_experts, self.config.num_experts_per_tok, x)


def load_balancing_loss(router_logits, num_experts, top_k, like):
    """Switch-Transformer aux loss, as transformers computes it: E * sum_e(fraction routed to e * mean prob of e),
    the fractions and means taken over every (layer, token) row together."""
    if not router_logits:
        return torch.zeros((), device=like.device, dtype=torch.float32)
    logits = torch.cat(router_logits, dim=0)                                  # [layers * T, E]
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    routed = F.one_hot(selected, num_experts).sum(dim=1).float().mean(dim=0)   # per expert, sums to top_k
    return num_experts * torch.sum(routed * probs.float().mean(dim=0))


# -----------------------------------------------------------------------------
# checkpoints: hub names on disk (one tensor per expert), fused experts in memory


def hf_weight_shapes(cfg: ModelConfig):
    """Every tensor name a transformers checkpoint of this config holds, with its shape (the name map's domain)."""
    H, D, E = cfg.hidden_size, cfg.head_dim, cfg.num_experts
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (cfg.num_attention_heads * D, H),
                       p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * D, H),
                       p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * D, H),
                       p + "self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,)})
        if cfg.attention_bias:
            for proj, n in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                            ("v", cfg.num_key_value_heads)):
                shapes[p + f"self_attn.{proj}_proj.bias"] = (n * D,)
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.is_moe_layer(i):
            I = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (E, H)
            for j in range(E):
                shapes.update({p + f"mlp.experts.{j}.gate_proj.weight": (I, H),
                               p + f"mlp.experts.{j}.up_proj.weight": (I, H),
                               p + f"mlp.experts.{j}.down_proj.weight": (H, I)})
        else:
            I = cfg.intermediate_size
            shapes.update({p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                           p + "mlp.down_proj.weight": (H, I)})
    return shapes


def hf_to_ours(hf: dict, cfg: ModelConfig) -> dict:
    """Hub tensors -> our state_dict: strip 'model.', fuse each MoE layer's experts into two stacked tensors."""
    ours = {}
    for name, t in hf.items():
        if ".mlp.experts." not in name:
            ours[name.removeprefix("model.")] = t
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            p = f"model.layers.{i}.mlp.experts."
            experts = range(cfg.num_experts)
            ours[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([hf[p + f"{j}.gate_proj.weight"], hf[p + f"{j}.up_proj.weight"]]) for j in experts])
            ours[f"layers.{i}.mlp.experts.down_proj"] = torch.stack([hf[p + f"{j}.down_proj.weight"] for j in experts])
    return ours


def ours_to_hf(sd: dict, cfg: ModelConfig) -> dict:
    """Our state_dict -> hub tensors: the inverse of hf_to_ours (experts split back to one tensor each)."""
    hf = {}
    for name, t in sd.items():
        if ".mlp.experts." in name:
            prefix, kind = "model." + name.rsplit(".", 1)[0] + ".", name.rsplit(".", 1)[1]
            for j in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[j].chunk(2, dim=0)
                    hf[prefix + f"{j}.gate_proj.weight"], hf[prefix + f"{j}.up_proj.weight"] = gate, up
                else:
                    hf[prefix + f"{j}.down_proj.weight"] = t[j]
        else:
            hf[name if name.startswith("lm_head") else "model." + name] = t
    return hf


def _read_safetensors(path):
    from safetensors import safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(single):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    tensors = {}
    for fname in files:
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
            raise FileNotFoundError(f"shard {fname!r} named by the index is missing from {path!r}")
        try:
            with safe_open(fpath, framework="pt") as f:
                for k in f.keys():
                    tensors[k] = f.get_tensor(k)
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"corrupt safetensors file {fpath!r}: {e}") from e
    return tensors


def _as_dtype(dtype):
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}: use e.g. 'float32', 'bfloat16', 'float16'")
        return getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    return dtype


def load_config(path) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}")
    try:
        with open(cfg_path) as f:
            return ModelConfig.from_hf_dict(json.load(f))
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"bad config.json in {path!r}: {e!r}") from e


def load_hf_checkpoint(path, device="cpu", dtype=torch.float32) -> Transformer:
    """Load a local transformers directory (config.json + safetensors, sharded or not) of model_type
    qwen3_moe or qwen3. Every name and shape is checked before anything is copied."""
    dtype = _as_dtype(dtype)
    cfg = load_config(path)
    hf = _read_safetensors(path)
    expected = hf_weight_shapes(cfg)
    if cfg.tie_word_embeddings:
        hf.pop("lm_head.weight", None)   # some tied checkpoints store the head anyway; it is the embedding
    unknown = sorted(set(hf) - set(expected))
    missing = sorted(set(expected) - set(hf))
    if unknown:
        raise ValueError(f"unknown tensor(s) in {path!r}: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    if missing:
        raise ValueError(f"missing tensor(s) in {path!r}: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
        if tuple(hf[name].shape) != shape:
            raise ValueError(f"tensor {name!r} in {path!r} has shape {tuple(hf[name].shape)}, expected {shape}")
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    ours = hf_to_ours(hf, cfg)
    state = model.state_dict()
    assert set(ours) == set(state), set(ours) ^ set(state)   # the name map is total, by construction
    with torch.no_grad():
        for name, t in ours.items():
            state[name].copy_(t)
    return model


def save_hf_checkpoint(model: Transformer, path):
    """Write config.json + model.safetensors (hub names, one tensor per expert). Files are written to a temp
    name and renamed, so a crash never leaves a half-written checkpoint under the real name."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    hf = {k: v.detach().contiguous().cpu() for k, v in ours_to_hf(model.state_dict(), model.config).items()}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(hf, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    hf_cfg = model.config.to_hf_dict()
    hf_cfg["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    tmp = os.path.join(path, "config.json.tmp")
    with open(tmp, "w") as f:
        json.dump(hf_cfg, f, indent=2)
    os.replace(tmp, os.path.join(path, "config.json"))


# -----------------------------------------------------------------------------
# paged KV cache and attention: the inference engine's side of attention (engine.py decides which page is whose)


class PagedKVCache:
    """Every layer's keys and values, in pages ("blocks") of `block_size` token slots.

    k[layer] and v[layer] are [num_blocks, block_size, kv_heads, head_dim]: a page is one contiguous chunk, so
    gathering a batch's pages is one index_select of whole pages (4 KB each at the embedded size; measured ~2-3x
    faster than gathering per head), and [B * pages, block_size, H, D] views as [B, L, H, D] -> transposed to
    [B, H, L, D] for attention, with no copy. Token p of a sequence lives in slot
    p % block_size of page block_table[p // block_size]. A page is only an index here; which sequence owns it
    is the engine's allocator's business."""

    def __init__(self, cfg: ModelConfig, num_blocks, block_size, device="cpu", dtype=torch.float32):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=_as_dtype(dtype))
        self.v = torch.zeros(shape, device=device, dtype=_as_dtype(dtype))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size, dtype):
        return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * _as_dtype(dtype).itemsize

    def copy_blocks(self, src, dst):
        """Copy pages src -> dst (1-D index tensors) in every layer: a forked sequence's private copy of a shared page."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


_compiled_flex_attention = None


def compiled_flex_attention():
    # compiled once per process; batch size and lengths change every engine step, so torch.compile's automatic
    # dynamic shapes (first call static, then the dims that changed go dynamic) keep recompiles to a few.
    # dynamic=True from the start hits an inductor C++ codegen error for CPU flex (torch 2.13, a 33-query prefill)
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


@dataclass(frozen=True)
class PagedGroup:
    """Sequences that attend in one padded call: rows [start, start + num_tokens) of the step's flat batch.
    Sequence b's queries are the group's rows query_index[b] (padded to Qmax by repeating its last row), they sit
    at positions query_pos[b], and its pages are block_tables[b]. query_index / token_row are None when every
    sequence of the group has Qmax new tokens (decodes: Qmax = 1): the rows are then already [B, Qmax] row-major."""
    start: int
    num_tokens: int
    block_tables: torch.Tensor              # [B, pages] int64
    query_pos: torch.Tensor                 # [B, Qmax] int64
    query_index: torch.Tensor | None = None  # [B, Qmax] int64, rows within the group
    token_row: torch.Tensor | None = None    # [num_tokens] int64: each row's place in the padded [B * Qmax]


class PagedAttention:
    """Attention for one engine step, built once and shared by every layer (the protocol of DocumentCausalAttention).

    The step's batch is a flat row of T new tokens: prefill chunks and single decode tokens mixed, in groups
    (the engine puts decodes in one group and prefill chunks in another, so that a long chunk does not pad every
    decode to its length). Per layer:
      1. the new tokens' k/v are written into their slots (slot_mapping [T], slot = page * block_size + offset),
      2. per group, each sequence's pages are gathered into a contiguous [B, kv_heads, L, D] view
         (L = pages * block_size; one index_select, a memcpy per page),
      3. the padded queries [B, heads, Qmax, D] attend to it under the mask kv_pos <= query_pos: causal, and blind
         to whatever lies in a page past the sequence's length (masks are built here, once per step).

    backend 'sdpa': torch's scaled_dot_product_attention with an additive mask, the query heads that share a kv
    head folded in as its extra queries. The CPU default: measured on one thread, 128 decoding sequences of
    ~100-160 tokens, 4 q / 2 kv heads, head_dim 32, one layer with its mask: sdpa 3.1 ms, compiled FlexAttention
    5.7 ms, eager FlexAttention 28 ms (before the folding, which took sdpa a further ~1.3x).
    Re-gathering every step looks wasteful, but keeping the decodes' KV gathered between steps (append one token
    per step, rows packed as sequences finish) measured 0.98x end to end: the gather leaves K/V hot in cache for
    SDPA, a kept buffer is read cold, and the bytes read from memory are what the time is.
    backend 'flex': FlexAttention with a BlockMask built directly from the positions (no create_block_mask, which
    costs 7-50 ms a call on CPU); compiled=True runs it through torch.compile (the fast path on CUDA)."""

    def __init__(self, cache: PagedKVCache, slot_mapping, groups, backend="sdpa", compiled=False):
        if backend not in ("sdpa", "flex"):
            raise ValueError(f"unknown paged attention backend {backend!r}: expected 'sdpa' or 'flex'")
        self.cache, self.slot_mapping, self.groups, self.backend = cache, slot_mapping, list(groups), backend
        self.flex = (compiled_flex_attention() if compiled else flex_attention) if backend == "flex" else None
        self.masks = []
        for g in self.groups:
            L = g.block_tables.shape[1] * cache.block_size
            if backend == "sdpa":
                kv_pos = torch.arange(L, device=g.query_pos.device)
                visible = kv_pos[None, None, None, :] <= g.query_pos[:, None, :, None]      # [B, 1, Qmax, L]
                # additive (0 / -inf), made once per step: a boolean mask is converted inside every layer's call
                mask = torch.zeros(visible.shape, dtype=cache.k.dtype, device=visible.device)
                self.masks.append(mask.masked_fill_(~visible, float("-inf")))
            else:
                self.masks.append(self._block_mask(g.query_pos, L))

    @staticmethod
    def _block_mask(query_pos, L, block=128):
        # the sparsity pattern straight from the positions: query tile j of sequence b needs kv tiles up to the
        # one holding its last query's position; every tile is "partial" (mask_mod decides inside it)
        B, Qmax = query_pos.shape
        n_q, n_kv = -(-Qmax // block), -(-L // block)
        last = torch.clamp(torch.arange(n_q, device=query_pos.device) * block + block - 1, max=Qmax - 1)
        kv_num_blocks = (query_pos[:, last] // block + 1).to(torch.int32)[:, None, :]          # [B, 1, n_q]
        kv_indices = torch.arange(n_kv, dtype=torch.int32, device=query_pos.device).expand(B, 1, n_q, n_kv)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= query_pos[b, q_idx]
        return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices.contiguous(), BLOCK_SIZE=(block, block),
                                        mask_mod=mask_mod, seq_lengths=(Qmax, L))

    def __call__(self, layer_idx, q, k, v):
        T, Hq, D = q.shape
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]      # [num_blocks, block_size, Hkv, D]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, self.slot_mapping, k)  # the new tokens into their slots
        vc.view(-1, *vc.shape[2:]).index_copy_(0, self.slot_mapping, v)
        ys = [self._attend(kc, vc, q[g.start:g.start + g.num_tokens], g, mask) for g, mask in zip(self.groups, self.masks)]
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def _attend(self, kc, vc, q, g, mask):
        T, Hq, D = q.shape
        Hkv = kc.shape[2]
        B, Qmax = g.query_pos.shape
        L = g.block_tables.shape[1] * self.cache.block_size
        pages = g.block_tables.view(-1)
        k = kc.index_select(0, pages).view(B, L, Hkv, D).transpose(1, 2)   # [B, Hkv, L, D], a view
        v = vc.index_select(0, pages).view(B, L, Hkv, D).transpose(1, 2)
        q = q.view(B, Qmax, Hq, D) if g.query_index is None else q[g.query_index]
        if self.backend == "sdpa":
            # the heads that share a kv head ride along as extra queries: [B, Hkv, group * Qmax, D] against
            # [B, Hkv, L, D], each K/V read once per kv head (enable_gqa reads it once per query head: measured
            # ~1.3x slower for decodes). Query head h uses kv head h // group, as in transformers.
            group = Hq // Hkv
            q = q.view(B, Qmax, Hkv, group, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, group * Qmax, D)
            mask = mask if Qmax == 1 else mask.repeat(1, 1, group, 1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            y = y.view(B, Hkv, group, Qmax, D).permute(0, 3, 1, 2, 4)      # [B, Qmax, Hkv, group, D]
        else:
            y = self.flex(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)
        # y: [B, Qmax, Hq, D]
        return y.reshape(T, Hq, D) if g.token_row is None else y.reshape(B * Qmax, Hq, D)[g.token_row]
