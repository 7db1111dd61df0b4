"""
A Qwen3-style transformer (MoE or dense) that matches Hugging Face transformers
to fp32 rounding.

    from model import ModelConfig, Transformer
    from checkpoint import load_hf_checkpoint, save_hf_checkpoint
    model = load_hf_checkpoint("path/to/hf_dir")    # qwen3_moe, qwen3, qwen2, llama; fp32 on cpu
    hidden, router_logits = model(tokens, position_ids, cu_seqlens)   # packed: [T], [T], [N+1]
    logits = model.logits(hidden)                        # the head, its own call: [T, V]
    logp = model.logprobs(hidden, labels)                # log p(label) per row, a chunk at a time
    aux_loss = model.aux_loss(router_logits, hidden)     # the router's load-balancing loss
    save_hf_checkpoint(model, "out/hf")                  # AutoModelForCausalLM loads it back

Everything is computed over a *packed* batch: the sequences are laid end to end in one
row of T tokens and `cu_seqlens` marks where each one starts, so there is no padding and
no attention across documents. How attention reads keys and values is a small object
handed to the forward (`attention=`): training uses DocumentCausalAttention (here,
the default); the inference engine hands in a PagedAttention that reads the paged KV
cache (inference/attention.py). The HF format on disk lives in checkpoint.py.

Semantics follow transformers' modeling_qwen3_moe.py line by line where it matters for
the numbers: RMSNorm in fp32, per-head q/k RMSNorm before RoPE, half-split RoPE, GQA,
router softmax (fp32) then top-k, renormalised only when `norm_topk_prob`, SwiGLU
experts, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step` say so, the
Switch-style load-balancing loss. The other families users bring are flags of the same
model (ModelConfig.family, set from config.json by checkpoint.py): Qwen2 has biases on
q, k and v and no q/k norm; Llama 3 has no q/k norm and its 'llama3' RoPE scaling; Qwen3
may carry YaRN scaling (rope_frequencies).
"""

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from checks import require, require_field

# -----------------------------------------------------------------------------
# config


# (qk_norm, qkv_bias) of each family: Qwen3 has the norm, Qwen2 the biases, Llama neither
FAMILY_FLAGS = {"qwen3": (True, False), "qwen2": (False, True), "llama": (False, False)}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384           # the dense MLP's width (dense layers and dense models)
    moe_intermediate_size: int = 128       # each expert's width
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32            # not hidden_size // heads in general: read it from the checkpoint
    num_experts: int = 8          # 0 = a dense model (Qwen3)
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # biases on q, k, v and o (Qwen3's / Llama's)
    # the families users bring are flags of this one model, set from config.json
    # (checkpoint.py)
    family: str = "qwen3"                  # 'qwen3' | 'qwen2' | 'llama' (with experts: qwen3_moe)
    qk_norm: bool | None = None            # per-head RMSNorm of q, k before RoPE (None: family's)
    qkv_bias: bool | None = None           # biases on q, k and v only (None: the family's; Qwen2's)
    rope_scaling: tuple = ()               # sorted (key, value) pairs; rope_type 'llama3' | 'yarn' 
    max_position_embeddings: int = 4096
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    # one id, or several (Llama 3 Instruct's three)
    eos_token_id: int | tuple | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        # json gives lists; a frozen config wants hashable tuples
        object.__setattr__(self, "mlp_only_layers",
                           tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling",
                               tuple(sorted(self.rope_scaling.items())))
        object.__setattr__(self, "rope_scaling",
                           tuple(tuple(kv) for kv in self.rope_scaling))
        need = functools.partial(require_field, self)
        # a list: an unhashable family is a ValueError too
        need("family", self.family in list(FAMILY_FLAGS), f"one of {list(FAMILY_FLAGS)}")
        need("num_experts", not self.num_experts or self.family == "qwen3",
             f"0 for family {self.family!r} (experts are Qwen3-MoE's)")
        for name, value in zip(("qk_norm", "qkv_bias"), FAMILY_FLAGS[self.family]):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
            need(name, getattr(self, name) == value, f"{value} for {self.family}")
        rope_type = dict(self.rope_scaling).get("rope_type")
        need("rope_scaling", rope_type in ("llama3", "yarn") or not self.rope_scaling,
             "of rope_type 'llama3' or 'yarn'")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "decoder_sparse_step"):
            value = getattr(self, name)
            need(name, type(value) is int and value >= 1, "a positive int")
        kv_heads, experts, top_k = (self.num_key_value_heads, self.num_experts,
                                    self.num_experts_per_tok)
        need("num_attention_heads", self.num_attention_heads % kv_heads == 0,
             f"a multiple of num_key_value_heads={kv_heads}")
        routed = not experts or 1 <= top_k <= experts
        require(routed, f"num_experts_per_tok={top_k}: not in [1, num_experts={experts}]")
        need("head_dim", self.head_dim % 2 == 0, "even (half-split RoPE)")

    def is_moe_layer(self, i):
        # the same rule as transformers' Qwen3MoeDecoderLayer
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def model_type(self):
        return "qwen3_moe" if self.num_experts > 0 else self.family


def as_dtype(dtype):
    """A torch.dtype from itself or its name ('float32', 'bfloat16', ...):
    configs stay serialisable."""
    if isinstance(dtype, str):
        is_dtype = isinstance(getattr(torch, dtype, None), torch.dtype)
        require(is_dtype, f"unknown dtype {dtype!r}: use e.g. 'float32', 'bfloat16'")
        return getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    return dtype


# -----------------------------------------------------------------------------
# building blocks


def rms_norm(x, weight, eps):
    # normalise the last dim in fp32 whatever the model dtype, then scale in the model
    # dtype (as transformers does)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(cfg: ModelConfig):
    """(inv_freq [head_dim / 2], the factor cos and sin are scaled by), for
    default RoPE and the two scalings a checkpoint may carry, computed as
    transformers' modeling_rope_utils does:
      llama3: frequencies whose wavelength exceeds original_max_position_embeddings /
              low_freq_factor are divided by factor, those below .../high_freq_factor kept, those
              between blended;
      yarn:   per dimension, a ramp between extrapolation (1 / base^(2i/d)) and interpolation (the
              same / factor) over the dimensions that rotate beta_slow..beta_fast times in the
              original context; cos and sin scaled by 0.1 ln(factor) + 1 (or attention_factor)."""
    D, base, s = cfg.head_dim, cfg.rope_theta, dict(cfg.rope_scaling)
    pos_freqs = base ** (torch.arange(0, D, 2, dtype=torch.float) / D)
    inv_freq, kind = 1.0 / pos_freqs, s.get("rope_type", "default")
    if kind == "llama3":
        factor, old = s["factor"], s["original_max_position_embeddings"]
        lo_f, hi_f = s["low_freq_factor"], s["high_freq_factor"]
        low, high = old / lo_f, old / hi_f                   # wavelengths
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - lo_f) / (hi_f - lo_f)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        return torch.where((wavelen >= high) & (wavelen <= low), blended, scaled), 1.0
    if kind == "yarn":
        old = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
        factor = s.get("factor") or cfg.max_position_embeddings / old
        scale = s.get("attention_factor") or \
            _yarn_mscale(factor, s.get("mscale"), s.get("mscale_all_dim"))

        def dim_of(rotations):
            # the dimension turning this many times over the original context
            return D * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))
        lo, hi = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, D - 1)
        ramp = ((torch.arange(D // 2, dtype=torch.float) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
        return (1.0 / (factor * pos_freqs)) * ramp + inv_freq * (1 - ramp), scale
    return inv_freq, 1.0


def _yarn_mscale(factor, mscale, mscale_all_dim):
    def get(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return get(factor, mscale) / get(factor, mscale_all_dim)
    return get(factor)


def rope_cos_sin(position_ids, inv_freq, scale, dtype):
    """cos/sin tables [T, head_dim] for half-split RoPE; angles in fp32, then
    cast like transformers."""
    freqs = position_ids.float()[:, None] * inv_freq.to(position_ids.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x, cos, sin):
    # x: [T, heads, head_dim]; rotate the two halves of each head (not interleaved pairs)
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# -----------------------------------------------------------------------------
# torch.compile, once per process (FlexAttention on a GPU, the engine's decode step)


@functools.cache
def compile_once(fn, dynamic=None, cpp_wrapper=False):
    """torch.compile(fn), once per process. Batch sizes and lengths change every call:
    flex takes torch.compile's automatic dynamic shapes (a few recompiles; dynamic=True
    fails in inductor's CPU flex codegen), the decode step (inference/decode.py)
    dynamic=True (one compile for every shape). cpp_wrapper: the code that calls the
    graph's kernels in C++, not Python (inductor's cpp_wrapper)."""
    return torch.compile(fn, dynamic=dynamic,
                         options={"cpp_wrapper": True} if cpp_wrapper else None)


# -----------------------------------------------------------------------------
# attention over a packed batch (training): how every layer reads its keys and values,
# unless the forward is handed another way (the engine's inference/attention.py)


class DocumentCausalAttention:
    """Causal attention within each packed document, built once per forward and shared
    by every layer.

    The default, on every device: the documents are laid into a padded [N, H, L, D] batch
    and SDPA runs causally on it: padding sits after each document's last token, so
    causality alone keeps every real query off it. That is N x L^2 work instead of T^2,
    same mask, same numbers. flex=True: FlexAttention with a document-causal mask_mod (a
    sparse BlockMask, no padding), compiled on a GPU (eager flex materialises the T x T
    scores, and has no CPU backward); not the default (docs/speed.md says why). With
    branch (training.pack_groups: completions that share their prompt's rows), a row
    also sees only branch 0 and its own branch: an explicit mask for SDPA, one more
    condition in the mask_mod."""

    def __init__(self, cu_seqlens, num_tokens, device, flex=False, branch=None):
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().to(device)
        self.flex = bool(flex)
        self.doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
        assert self.doc.numel() == num_tokens, (self.doc.numel(), num_tokens)   # cu_seqlens, tokens
        self.num_tokens, self.device = num_tokens, device
        self.num_docs, self.max_len = len(lengths), int(lengths.max()) if len(lengths) else 0
        self.pos = torch.arange(num_tokens,
                                device=device) - cu_seqlens[:-1].long().to(device)[self.doc]
        self._block_mask = self._mask = None
        self.branch = branch = None if branch is None else branch.to(device).long()
        doc = self.doc

        def mask_mod(b, h, q_idx, kv_idx):   # flex wants a plain function of four indices
            same = (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)
            if branch is None:
                return same
            return same & ((branch[kv_idx] == 0) | (branch[kv_idx] == branch[q_idx]))
        self.mask_mod = mask_mod

    def _branch_mask(self):
        """[N, 1, L, L] bool for the padded layout: causal, and a row sees branch 0 and
        its own branch. Padding is branch 0 after each document's last row: no real row
        sees it, and a padding row always sees a row."""
        br = self.branch.new_zeros(self.num_docs, self.max_len)
        br[self.doc, self.pos] = self.branch
        i = torch.arange(self.max_len, device=br.device)
        causal = i[None, :] <= i[:, None]
        return (causal & ((br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])))[:, None]

    def __call__(self, layer_idx, q, k, v):
        # q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]
        if not self.flex:
            def pad(t):   # [T, H, D] -> [N, H, L, D], each document from position 0
                out = t.new_zeros(self.num_docs, self.max_len, *t.shape[1:])
                out[self.doc, self.pos] = t
                return out.transpose(1, 2)
            if self.branch is None:
                y = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), is_causal=True,
                                                   enable_gqa=True)
            else:
                if self._mask is None:   # one mask for every layer
                    self._mask = self._branch_mask()
                y = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=self._mask,
                                                   enable_gqa=True)
            return y.transpose(1, 2)[self.doc, self.pos]
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))   # [1, H, T, D]
        # eager FlexAttention materialises the T x T scores: on a GPU it runs compiled
        # (a fused kernel that skips the blocks the mask leaves out), and its mask is
        # built compiled too
        on_gpu = torch.device(self.device).type != "cpu"
        if self._block_mask is None:
            make_mask = compile_once(create_block_mask) if on_gpu else create_block_mask
            self._block_mask = make_mask(self.mask_mod, None, None, self.num_tokens,
                                         self.num_tokens, device=self.device)
        flex = compile_once(flex_attention) if on_gpu else flex_attention
        y = flex(q, k, v, block_mask=self._block_mask, enable_gqa=True)
        return y.squeeze(0).transpose(0, 1)


# -----------------------------------------------------------------------------
# LoRA's place in the forward (lora.py adds the adapters, trains and saves them)


class LoRA(nn.Module):
    """A low-rank update beside a frozen weight W ([out, in], or a stack of E experts'
    [E, out, in], one adapter each): the layer reads x W^T + scale (x A^T) B^T. It is
    never merged into W + scale B A in the forward, so the backward keeps nothing of W's
    size, and an engine can read the trainer's W itself (lora.sharing_base)."""

    def __init__(self, shape, rank, scale):
        super().__init__()
        *lead, out, inp = shape
        self.scale = scale
        self.A = nn.Parameter(torch.empty(*lead, rank, inp))
        self.B = nn.Parameter(torch.zeros(*lead, out, rank))

    def forward(self, x):                       # one weight's: [.., in] -> [.., out]
        return self.scale * F.linear(F.linear(x, self.A), self.B)

    def delta(self):
        """scale B @ A, the update as a weight (the merged checkpoints' W + delta)."""
        return self.scale * (self.B @ self.A)

    def per_expert(self):
        """[(A_e, B_e, scale)] (unbind: one stack in the backward, where w[e] would write
        an all-experts-sized zero tensor per expert)."""
        return [(a, b, self.scale) for a, b in zip(self.A.unbind(0), self.B.unbind(0))]


class Linear(nn.Linear):
    """nn.Linear, with room for a LoRA adapter beside its weight (weight_lora)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_lora = None

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return y if self.weight_lora is None else y + self.weight_lora(x)


def adapted(x, weight, adapter=None):
    """x W^T, plus scale (x A^T) B^T for an expert's adapter (A, B, scale)."""
    y = F.linear(x, weight)
    if adapter is None:
        return y
    A, B, scale = adapter
    return y + scale * F.linear(F.linear(x, A), B)


def stacked_linear(matmul, x, weight, lora):
    """matmul(x, W^T) over a stack of experts' weights [E, out, in], plus an adapter's
    scale matmul(matmul(x, A^T), B^T): torch.matmul (every expert on every row) or a
    grouped GEMM (each expert on its slice)."""
    y = matmul(x, weight.transpose(1, 2))
    if lora is None:
        return y
    return y + lora.scale * matmul(matmul(x, lora.A.transpose(1, 2)), lora.B.transpose(1, 2))


# -----------------------------------------------------------------------------
# the layers


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = (cfg.num_attention_heads,
                                                      cfg.num_key_value_heads, cfg.head_dim)
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_head * self.head_dim, bias=qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_head * self.head_dim, bias=qkv_bias)
        self.o_proj = Linear(self.n_head * self.head_dim, cfg.hidden_size,
                                bias=cfg.attention_bias)
        if cfg.qk_norm:
            # per head, before RoPE
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention):
        # q, k and v in one matmul, and q and k normalised and rotated together as one [T,
        # n_head + n_kv_head, D] tensor: the same numbers as three projections, two norms
        # and two RoPEs, in a third of the calls (at decode sizes each call costs more in
        # overhead than in arithmetic)
        T, Hq, Hkv, D = x.shape[0], self.n_head, self.n_kv_head, self.head_dim
        projs = (self.q_proj, self.k_proj, self.v_proj)
        if all(p.weight_lora is None for p in projs):
            bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
            qkv = F.linear(x, torch.cat([p.weight for p in projs]), bias)
        else:   # LoRA: each with its adapter, and no [3 W] concatenation kept for the backward
            qkv = torch.cat([p(x) for p in projs], dim=-1)
        qkv = qkv.view(T, Hq + 2 * Hkv, D)
        # split, not slices: its backward is one cat, no zeros
        qk, v = qkv.split([Hq + Hkv, Hkv], dim=1)
        if hasattr(self, "q_norm"):
            # Qwen3: q and k normalised per head (they share cfg's eps)
            norm_w = torch.cat((self.q_norm.weight.expand(Hq, D),
                                self.k_norm.weight.expand(Hkv, D)))
            qk = rms_norm(qk, norm_w, self.q_norm.eps)
        qk = apply_rope(qk, cos, sin)
        q, k = qk.split([Hq, Hkv], dim=1)
        y = attention(self.layer_idx, q, k, v)                    # [T, n_head, head_dim]
        return self.o_proj(y.reshape(T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """The dense SwiGLU MLP (Qwen3, and Qwen3-MoE's mlp_only layers)."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """E SwiGLU experts kept fused: gate and up stacked as [E, 2I, H], down as [E, H, I];
    with room for a LoRA adapter on each stack (gate_up_proj_lora, down_proj_lora)."""

    def __init__(self, num_experts, hidden_size, intermediate_size):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size,
                                                     hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.gate_up_proj_lora = self.down_proj_lora = None

    def forward(self, x, top_idx, top_w):
        # x [T, H]; top_idx / top_w [T, k]: token t goes to experts top_idx[t] with
        # weights top_w[t]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._every_expert(x, top_idx, top_w)
        # sort the T*k (token, slot) pairs by expert so each expert's tokens are one
        # contiguous slice
        T, k = top_idx.shape
        flat = top_idx.flatten()
        order = flat.argsort(stable=True)
        xs = x.index_select(0, order // k)  # the token of each pair, expert by expert
        # tokens per expert (a bincount, whose output size torch.compile cannot
        # know in advance)
        counts = flat.new_zeros(self.gate_up_proj.shape[0])
        counts.index_add_(0, flat, torch.ones_like(flat))
        if _use_grouped_mm(x, self):
            ys = self._grouped(xs, counts)
        else:
            ys = self._loop(xs, counts.tolist())
        # back to (token, slot) order by gathering with the inverse permutation
        # (deterministic, unlike a scatter-add), then each token's k outputs
        # weighted and summed
        y = ys.index_select(0, order.argsort()).view(T, k, -1)
        return (y * top_w[..., None]).sum(dim=1)

    def _loop(self, xs, counts):
        # the readable path (and the one with gradients): one SwiGLU per expert over its
        # slice. split / unbind rather than xs[a:b] / w[e]: their backward is one cat /
        # stack, where each slice's backward would write a zero tensor the size of all of
        # xs (or of all experts' weights) per expert
        E = len(counts)
        gate_up_lora, down_lora = (lora.per_expert() if lora is not None else [None] * E
                                   for lora in (self.gate_up_proj_lora, self.down_proj_lora))
        ys = []
        for e, (x, gate_up, down) in enumerate(zip(xs.split(counts), self.gate_up_proj.unbind(0),
                                                   self.down_proj.unbind(0))):
            if len(x):
                gate, up = adapted(x, gate_up, gate_up_lora[e]).chunk(2, dim=-1)
                ys.append(adapted(F.silu(gate) * up, down, down_lora[e]))
        return torch.cat(ys)

    def _every_expert(self, x, top_idx, top_w):
        # inside a CUDA graph (inference/decode.py's decode step) nothing may wait on the
        # host, as the loop's slice sizes do: every expert runs on every token (E / k
        # times the FLOPs, for a decode step's few tokens), and each token keeps its k
        # outputs, weighted and summed as above
        linear = functools.partial(stacked_linear, torch.matmul)   # [T or E, T, in] -> [E, T, out]
        gate, up = linear(x, self.gate_up_proj, self.gate_up_proj_lora).chunk(2, dim=-1)
        ys = linear(F.silu(gate) * up, self.down_proj, self.down_proj_lora)   # [E, T, H]
        y = ys[top_idx, torch.arange(len(x), device=x.device)[:, None]]       # [T, k, H]
        return (y * top_w[..., None]).sum(dim=1)

    def _grouped(self, xs, counts):
        # the same two matmuls for all experts in one grouped-GEMM call each (offs = where
        # each slice ends), and an adapter's two low-rank ones
        offs = counts.cumsum(0).to(torch.int32)
        linear = functools.partial(stacked_linear, functools.partial(grouped_mm, offs=offs))
        gate, up = linear(xs, self.gate_up_proj, self.gate_up_proj_lora).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj, self.down_proj_lora)


# an opaque op for torch.compile, registered on the dispatcher directly:
# torch.library.custom_op's Python wrapper costs tens of microseconds a call, and a decode
# step makes a dozen of them
_OPS = torch.library.Library("nanorl", "FRAGMENT")
_OPS.define("grouped_mm(Tensor x, Tensor w, Tensor offs) -> Tensor")
_OPS.impl("grouped_mm", lambda x, w, offs: torch._grouped_mm(x, w, offs=offs), "CPU")


@torch.library.register_fake("nanorl::grouped_mm")
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


def grouped_mm(x, w, offs):
    # torch.compile cannot trace torch._grouped_mm on the CPU in fp32, so a compiled forward
    # calls it as an opaque op (its output shape registered above); eager calls it directly
    if torch.compiler.is_compiling():
        return torch.ops.nanorl.grouped_mm(x, w, offs)
    return torch._grouped_mm(x, w, offs=offs)


# torch's grouped GEMM on CPU runs forward only (no backward: training takes the loop) and
# wants 16-byte row strides (hidden and expert widths multiples of 4 in fp32). Where it
# runs, inference takes it (bench/bench.py compares). GROUPED_MM = False forces the loop
# everywhere (the reference the tests compare against).
GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_experts(cfg: ModelConfig, device, dtype):
    """Whether inference runs every MoE layer's experts as grouped matmuls (true of a
    dense model): what a compiled forward needs, as the loop's per-expert split
    breaks its graph."""
    return cfg.num_experts == 0 or _grouped_fits(device, dtype, cfg.hidden_size,
                                                 cfg.moe_intermediate_size)


def _grouped_fits(device, dtype, hidden, width):
    return (GROUPED_MM and torch.device(device).type == "cpu" and dtype == torch.float32
            and hidden % 4 == 0 and width % 4 == 0)


def _use_grouped_mm(x, experts):
    # CPU fp32 inference with aligned widths (an adapter's rank too); anything that needs
    # gradients takes the loop
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad
                                                           for p in experts.parameters())):
        return False
    ranks = [lora.A.shape[1] for lora in (experts.gate_up_proj_lora, experts.down_proj_lora)
             if lora is not None]
    _, hidden, width = experts.down_proj.shape   # [E, H, I]
    return all(_grouped_fits(x.device, x.dtype, hidden, r) for r in ranks) and \
        _grouped_fits(x.device, x.dtype, hidden, width)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size,
                               cfg.moe_intermediate_size)

    def forward(self, x, routes=None):
        """(output, router_logits, the experts each row used [T, k]). routes [T, k]:
        routing replay, the experts each row must use (another forward's choice, e.g.
        the engine's); a row of -1 routes itself. The gates are still this router's
        probabilities at those experts, so the router keeps its gradient."""
        router_logits = self.gate(x)                                     # [T, E]
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float)      # softmax first, then top-k
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if routes is not None:
            top_idx = torch.where(routes[:, :1] >= 0, routes, top_idx)
            top_w = probs.gather(-1, top_idx)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return self.experts(x, top_idx, top_w.to(x.dtype)), router_logits, top_idx


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, attention, routes=None):
        """(output, router_logits, experts used): the last two None in a dense layer."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, router_logits, used = self.mlp(h, routes)
            return x + h, router_logits, used
        return x + self.mlp(h), None, None


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
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope = None                  # (inv_freq, cos/sin scale), on first use
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
        """Parameters one token touches: experts count top_k / E of their weights
        (for FLOP estimates)."""
        cfg, n = self.config, 0
        for name, p in self.named_parameters():
            n += p.numel() * (cfg.num_experts_per_tok / cfg.num_experts if ".experts." in name
                              else 1.0)
        return int(n) - self.embed_tokens.weight.numel() * (0 if cfg.tie_word_embeddings else 1)

    def rope(self, device):
        """(inv_freq, cos/sin scale) on device, made once per model and device: a function
        of the config only (a copy per forward would sync a GPU, and a CUDA graph
        cannot hold that)."""
        if self._rope is None or self._rope[0].device != device:
            inv_freq, scale = rope_frequencies(self.config)
            self._rope = (inv_freq.to(device), scale)
        return self._rope

    def forward(self, tokens, position_ids, cu_seqlens=None, attention=None, branch=None,
                routes=None, routes_out=None):
        """The blocks on a packed batch: (hidden [T, D], the final norm's output, and the
        router logits [T, E] of each MoE layer, a list). tokens, position_ids: [T];
        cu_seqlens: int32 [N+1] document boundaries. attention: how to attend (default:
        causal within each document of cu_seqlens; with branch [T], documents whose
        completions share a prompt, training.pack_groups: a row sees its own branch and
        branch 0). routes [T, M, k]: routing replay, the experts each row uses in each of
        the M MoE layers (-1: its own choice); routes_out: a list that receives the
        experts each MoE layer used, [T, k] each. The head is its own call: logits (the
        engine's), logprobs (the trainers'), and aux_loss for the router logits.

            hidden, router_logits = model(tokens, position_ids, cu_seqlens)
            logits = model.logits(hidden[last_rows])              # [N, V]
            logp = model.logprobs(hidden, labels, temperature)    # [T], no [T, V] tensor
            aux = model.aux_loss(router_logits, hidden)           # 0-dim"""
        assert tokens.dim() == 1 and position_ids.shape == tokens.shape
        # an attention already holds its mask (DocumentCausalAttention(..., branch=...))
        require(attention is None or branch is None, "pass branch or attention, not both")
        T = tokens.shape[0]
        if attention is None:
            if cu_seqlens is None:
                cu_seqlens = torch.tensor([0, T], dtype=torch.int32)
            attention = DocumentCausalAttention(cu_seqlens, T, tokens.device,
                                                branch=branch)
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(position_ids, *self.rope(x.device), x.dtype)
        router_logits = []
        for layer in self.layers:
            replay = None if routes is None or not layer.is_moe else routes[:, len(router_logits)]
            x, r, used = layer(x, cos, sin, attention, replay)
            if r is not None:
                router_logits.append(r)
                if routes_out is not None:
                    routes_out.append(used)
        return self.norm(x), router_logits

    def head_weight(self):
        # a tied head reads the embedding matrix
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden, temperature=1.0):
        """logits / temperature of hidden states [N, D]: [N, V]."""
        logits = F.linear(hidden, self.head_weight())
        return logits / temperature if temperature != 1.0 else logits

    def logprobs(self, hidden, labels, temperature=1.0):
        """log_softmax(logits / temperature)[label] per row of hidden [T, D], labels [T]:
        [T] fp32, made a chunk of rows at a time (head_logprobs), so no [T, V] tensor is
        ever whole: the trainers' path."""
        return head_logprobs(hidden, self.head_weight(), labels, temperature)

    def aux_loss(self, router_logits, like):
        """The load-balancing loss over the MoE layers' router logits (transformers'
        load_balancing_loss_func), a 0-dim tensor (0 for a dense model, on like's
        device)."""
        return load_balancing_loss(router_logits, self.config.num_experts,
                                   self.config.num_experts_per_tok, like)


# -----------------------------------------------------------------------------
# the head's logprobs, a chunk of rows at a time: at a real vocabulary (151,936) a
# 16k-token batch's fp32 logits alone are 10 GB, and log_softmax and its gradient each
# want as much again


def head_logprobs(hidden, weight, labels, temperature=1.0, chunk_bytes=256 * 2 ** 20):
    """log_softmax(hidden @ weight.T / temperature)[label] per row, [T, D] x [V, D] -> [T]
    fp32, equal to the whole computation. At most two [rows, V] fp32 tensors (chunk_bytes
    at most each) exist at once, forward or backward: one chunk's logits and their
    log-softmax (forward) or softmax (backward, which recomputes each chunk's logits, as
    fused linear-cross-entropy kernels do). Under autocast the matmuls run in the
    autocast dtype, as F.linear would, and a copy in it (half the bytes) may sit beside
    one of the two."""
    assert hidden.dim() == 2 and labels.shape == hidden.shape[:1], (hidden.shape, labels.shape)
    kind = hidden.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else hidden.dtype
    rows = max(1, chunk_bytes // (4 * weight.shape[0]))
    return HeadLogprobs.apply(hidden, weight, labels, float(temperature), rows, dtype)


class HeadLogprobs(torch.autograd.Function):
    """d logp_t / d logits_t = (onehot(label_t) - softmax(logits_t / T)) / T: each chunk's
    logits are made again in backward and turned into the gradients of hidden and
    weight right away."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, rows, dtype):
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], rows):
                logits = F.linear(hidden[s:s + rows].to(dtype), w).float().div_(temperature)
                logp = torch.log_softmax(logits, -1)
                out[s:s + rows] = logp.gather(1, labels[s:s + rows, None])[:, 0]
                del logits, logp   # gone before the next chunk's are made
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.rows, ctx.dtype = temperature, rows, dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels = ctx.saved_tensors
        T, rows, dtype = ctx.temperature, ctx.rows, ctx.dtype
        grad_hidden = torch.empty_like(hidden)
        # a frozen head (LoRA, lora.py) gets no gradient: the [V, D] fp32 buffer is the
        # size of the embedding
        wants_weight = ctx.needs_input_grad[1]
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32,
                                  device=weight.device) if wants_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], rows):
                h, g = hidden[s:s + rows].to(dtype), grad[s:s + rows].float() / T
                d = torch.softmax(F.linear(h, w).float().div_(T), -1).mul_(-g[:, None])
                # + onehot(label) * g
                d.scatter_add_(1, labels[s:s + rows, None], g[:, None])
                grad_hidden[s:s + rows] = (d.to(dtype) @ w).to(hidden.dtype)
                if wants_weight:
                    grad_weight += (d.t().to(dtype) @ h).float()
                del d
        grad_weight = grad_weight.to(weight.dtype) if wants_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def load_balancing_loss(router_logits, num_experts, top_k, like):
    """Switch-Transformer aux loss, as transformers computes it: E * sum_e(fraction
    routed to e * mean prob of e), the fractions and means taken over every (layer,
    token) row together."""
    if not router_logits:
        return torch.zeros((), device=like.device, dtype=torch.float32)
    logits = torch.cat(router_logits, dim=0)  # [layers * T, E]
    probs = F.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, top_k, dim=-1)
    # per expert, sums to top_k
    routed = F.one_hot(selected, num_experts).sum(dim=1).float().mean(dim=0)
    return num_experts * torch.sum(routed * probs.float().mean(dim=0))


def train_flops(config: ModelConfig, seqlens, pairs=None, frozen=False):
    """FLOPs of one forward+backward over packed sequences of these lengths (a forward
    alone is a third): 6 per active matmul weight per token (experts count top_k of E,
    the router and the head count, the embedding lookup doesn't) plus attention's QK^T
    and AV over the causal pairs within each sequence (or over `pairs` query-key pairs:
    a batch's sum of position_ids + 1, which also holds where completions share a
    prompt). frozen: the weights are LoRA's frozen base, whose backward makes the
    activations' gradient but not the weight's: 4 per weight per token (the adapters'
    own low-rank matmuls, rank / width of the rest, left out)."""
    H, D = config.hidden_size, config.head_dim
    per_token = config.vocab_size * H
    for i in range(config.num_hidden_layers):
        per_token += H * D * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
        if config.is_moe_layer(i):
            per_token += (
                config.num_experts * H
                + config.num_experts_per_tok * 3 * H * config.moe_intermediate_size
            )
        else:
            per_token += 3 * H * config.intermediate_size
    pairs = sum(n * (n + 1) // 2 for n in seqlens) if pairs is None else pairs
    return (
        (4 if frozen else 6) * per_token * sum(seqlens)
        + 12 * config.num_hidden_layers * config.num_attention_heads * D * pairs
    )
