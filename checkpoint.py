"""
Everything on disk: the Hugging Face format of a model, and the training checkpoints
built on it.

    from checkpoint import load_hf_checkpoint, save_hf_checkpoint
    model = load_hf_checkpoint("path/to/hf_dir")       # qwen3_moe, qwen3, qwen2, llama; fp32 on cpu
    save_hf_checkpoint(model, "out/hf")                         # AutoModelForCausalLM loads it back

    # {out_dir}/ckpt, atomically
    save_checkpoint(out_dir, model, optimizer, tok, iter_num, config, data_state)
    meta = read_checkpoint_meta(find_checkpoint(out_dir))        # verified before it is trusted
    start = init_start(config, build_tokenizer)                  # scratch, a stage's dir, or resume

The hub stores one tensor per expert
(`model.layers.{i}.mlp.experts.{j}.gate_proj.weight`); in memory the experts are fused
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`). The name map below (hf_to_ours /
ours_to_hf) is the only place that knows both spellings.

A training checkpoint {out_dir}/ckpt is a complete transformers model directory
(config.json, model.safetensors, the tokenizer) plus trainer_state.pt (optimizer, RNG
states) and checkpoint.json (iteration, config, data state, and the size and xxh64 of
every file, written last). A LoRA run's (lora.py) model.safetensors is the merged model,
beside its adapter in PEFT's format (adapter/) and, in checkpoint.json, the base it
adapts (path and digest): resume rebuilds base + adapters exactly. It is built in
ckpt.tmp and swapped in by two renames; a run
killed between them leaves ckpt.old, which resume falls back to. The next stage's
init_from is the out_dir itself.
"""

import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, fields, replace

import numpy as np
import torch
import xxhash

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

import lora
from checks import require
from configurator import print0
from scaleout import distributed
from model import ModelConfig, Transformer, as_dtype
from tokenizer import generation_stop_ids, load_tokenizer, save_tokenizer

# -----------------------------------------------------------------------------
# config.json <-> ModelConfig


# the families of one Transformer: model_type -> ModelConfig flags (model.py), and
# what each allows
FAMILIES = {
    "qwen3_moe": dict(family="qwen3", qk_norm=True, rope=("default", "yarn")),
    "qwen3": dict(family="qwen3", qk_norm=True, rope=("default", "yarn")),
    "qwen2": dict(family="qwen2", qk_norm=False, qkv_bias=True, rope=("default",)),
    "llama": dict(family="llama", qk_norm=False, rope=("default", "llama3")),
}


def rope_of(d):
    """(rope_theta, rope_type, the scaling's other keys) of a config.json, either
    spelling: transformers 5's rope_parameters, or rope_theta + rope_scaling."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.pop("rope_type", rope.pop("type", "default"))
    theta = float(rope.pop("rope_theta", d.get("rope_theta", 10000.0)))
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported (RoPE over the whole head)")
    return theta, kind, rope if kind != "default" else {}


def config_from_hf(d) -> ModelConfig:
    """A transformers config.json (qwen3_moe, qwen3, qwen2 or llama) -> ModelConfig.
    Unsupported variants are refused, naming the model_type and what is missing."""
    model_type = d.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}: not one of {sorted(FAMILIES)}")
    flags = dict(FAMILIES[model_type])
    if d.get("use_sliding_window") or (model_type == "llama" and d.get("sliding_window")):
        raise ValueError(f"{model_type}: sliding-window attention is not supported")
    bias, act = d.get("mlp_bias"), d.get("hidden_act", "silu")
    if bias or act != "silu":
        raise ValueError(f"{model_type}: mlp_bias={bias}, hidden_act={act!r}: only SiLU, no bias")
    theta, rope_type, scaling = rope_of(d)
    if rope_type not in flags.pop("rope"):
        raise ValueError(f"{model_type}: rope_type {rope_type!r} is not supported for this family")
    is_moe = model_type == "qwen3_moe"
    eos = d.get("eos_token_id")
    return ModelConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d.get("intermediate_size", 4 * d["hidden_size"]),
        moe_intermediate_size=d.get("moe_intermediate_size", 0) if is_moe else 0,
        num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
        head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
        num_experts=d.get("num_experts", d.get("num_local_experts", 0)) if is_moe else 0,
        num_experts_per_tok=d.get("num_experts_per_tok", 1) if is_moe else 1,
        norm_topk_prob=d.get("norm_topk_prob", False),
                       decoder_sparse_step=d.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(d.get("mlp_only_layers", ())),
                       rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=theta, rope_scaling=dict(scaling, rope_type=rope_type) if scaling else (),
        **flags,
        tie_word_embeddings=d.get("tie_word_embeddings", False),
                       attention_bias=d.get("attention_bias", False),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
                       bos_token_id=d.get("bos_token_id"),
        eos_token_id=eos, pad_token_id=d.get("pad_token_id"),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """ModelConfig -> a config.json dict, built by transformers' own config class (so
    transformers reads it)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
    kw = {k: v for k, v in asdict(cfg).items()
          if k not in ("num_experts", "family", "qk_norm", "qkv_bias", "rope_scaling")}
    kw["mlp_only_layers"] = list(cfg.mlp_only_layers)
    if isinstance(cfg.eos_token_id, tuple):
        kw["eos_token_id"] = list(cfg.eos_token_id)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw.pop("rope_theta"),
                             **dict(cfg.rope_scaling)}
    if cfg.num_experts > 0:
        hf = Qwen3MoeConfig(num_experts=cfg.num_experts, **kw)
        hf.architectures = ["Qwen3MoeForCausalLM"]
        return hf.to_dict()
    for k in ("moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef"):
        kw.pop(k)
    if cfg.family == "qwen2":
        kw.pop("attention_bias")          # Qwen2's q, k, v always have biases, o never
        hf, arch = Qwen2Config(**kw), "Qwen2ForCausalLM"
    elif cfg.family == "llama":
        hf, arch = LlamaConfig(mlp_bias=False, **kw), "LlamaForCausalLM"
    else:
        hf, arch = Qwen3Config(**kw), "Qwen3ForCausalLM"
    hf.architectures = [arch]
    return hf.to_dict()


def load_config(path) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"no config.json in {path!r}")
    try:
        with open(cfg_path) as f:
            return config_from_hf(json.load(f))
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"bad config.json in {path!r}: {e!r}") from e


# -----------------------------------------------------------------------------
# the weight-name map: hub names on disk (one tensor per expert), fused experts in memory


def hf_weight_shapes(cfg: ModelConfig):
    """Every tensor name a transformers checkpoint of this config holds, with its shape
    (the name map's domain)."""
    H, D, E, Hq, Hkv = (
        cfg.hidden_size,
        cfg.head_dim,
        cfg.num_experts,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    )
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, H), "model.norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,),
                       p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (Hq * D, H),
                       p + "self_attn.k_proj.weight": (Hkv * D, H),
                       p + "self_attn.v_proj.weight": (Hkv * D, H),
                       p + "self_attn.o_proj.weight": (H, Hq * D)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (D,),
                           p + "self_attn.k_norm.weight": (D,)})
        if cfg.attention_bias or cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (Hq * D,),
                           p + "self_attn.k_proj.bias": (Hkv * D,),
                           p + "self_attn.v_proj.bias": (Hkv * D,)})
        if cfg.attention_bias:
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
    """Hub tensors -> our state_dict: strip 'model.', fuse each MoE layer's experts into
    two stacked tensors."""
    ours = {name.removeprefix("model."): t for name, t in hf.items() if ".mlp.experts." not in name}
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            p, experts = f"model.layers.{i}.mlp.experts.", range(cfg.num_experts)
            ours[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
                [torch.cat([hf[p + f"{j}.gate_proj.weight"], hf[p + f"{j}.up_proj.weight"]])
                 for j in experts])
            ours[f"layers.{i}.mlp.experts.down_proj"] = torch.stack(
                [hf[p + f"{j}.down_proj.weight"] for j in experts]
            )
    return ours


def ours_to_hf(sd: dict) -> dict:
    """Our state_dict -> hub tensors: the inverse of hf_to_ours (experts split back to
    one tensor each)."""
    hf = {}
    for name, t in sd.items():
        if ".mlp.experts." not in name:
            hf[name if name.startswith("lm_head") else "model." + name] = t
            continue
        prefix, kind = "model." + name.rsplit(".", 1)[0] + ".", name.rsplit(".", 1)[1]
        for j in range(t.shape[0]):
            if kind == "gate_up_proj":
                hf[prefix + f"{j}.gate_proj.weight"], hf[prefix + f"{j}.up_proj.weight"] = t[
                    j
                ].chunk(2, dim=0)
            else:
                hf[prefix + f"{j}.down_proj.weight"] = t[j]
    return hf


# -----------------------------------------------------------------------------
# reading and writing a transformers directory


def read_safetensors(path):
    """Every tensor of a directory's model.safetensors (or of the shards its index names)."""
    from safetensors import safe_open
    index, single = (os.path.join(path, n)
                     for n in ("model.safetensors.index.json", "model.safetensors"))
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
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
        except Exception as e:
            # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"corrupt safetensors file {fpath!r}: {e}") from e
    return tensors


def first_five(names):
    return f"{names[:5]}{' ...' if len(names) > 5 else ''}"


def load_hf_checkpoint(path, device="cpu", dtype=torch.float32) -> Transformer:
    """Load a local transformers directory (config.json + safetensors, sharded or not) of
    model_type qwen3_moe, qwen3, qwen2 or llama. Every name and shape is checked before
    anything is copied."""
    dtype = as_dtype(dtype)
    cfg = load_config(path)
    hf = read_safetensors(path)
    expected = hf_weight_shapes(cfg)
    if cfg.tie_word_embeddings:
        # some tied checkpoints store the head anyway; it is the embedding
        hf.pop("lm_head.weight", None)
    unknown, missing = sorted(set(hf) - set(expected)), sorted(set(expected) - set(hf))
    if unknown or missing:
        unknown, missing = first_five(unknown), first_five(missing)
        raise ValueError(f"{path!r}: unknown tensors {unknown}, missing {missing}")
    for name, shape in expected.items():
        if tuple(hf[name].shape) != shape:
            raise ValueError(f"{name!r} in {path!r}: shape {tuple(hf[name].shape)}, not {shape}")
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device=device).to(dtype)
    state = model.state_dict()
    with torch.no_grad():
        # the name map is total (hf_weight_shapes is its domain)
        for name, t in hf_to_ours(hf, cfg).items():
            state[name].copy_(t)
    return model


def _write_atomically(path, write):
    # write to a temp name, then rename: a crash never leaves a half-written file under
    # the real name
    write(path + ".tmp")
    os.replace(path + ".tmp", path)


def save_hf_checkpoint(model: Transformer, path, weights=None):
    """Write config.json + model.safetensors (hub names, one tensor per expert),
    each file atomically; weights: model's state_dict (the default), or its tensors
    gathered from shards."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    weights = model.state_dict() if weights is None else weights
    hf = {k: v.detach().contiguous().cpu() for k, v in ours_to_hf(weights).items()}
    _write_atomically(os.path.join(path, "model.safetensors"),
                      lambda p: save_file(hf, p, metadata={"format": "pt"}))
    hf_cfg = config_to_hf(model.config) | {
        "dtype": str(next(iter(weights.values())).dtype).removeprefix("torch.")
    }

    def write_json(p):
        with open(p, "w") as f:
            json.dump(hf_cfg, f, indent=2)
    _write_atomically(os.path.join(path, "config.json"), write_json)


# -----------------------------------------------------------------------------
# training checkpoints: the model directory + trainer state + a verified manifest

CKPT, CKPT_TMP, CKPT_OLD = "ckpt", "ckpt.tmp", "ckpt.old"
META = "checkpoint.json"
TRAINER_STATE = "trainer_state.pt"
ADAPTER = "adapter"
OPTIMIZER = "optimizer"      # a sharded run's optimizer (torch.distributed.checkpoint)


def whole_weights(model):
    """model's state_dict whole on rank 0 (None on the others): a sharded model's gathered
    one tensor at a time, every rank taking part, each kept on rank 0's CPU."""
    if not distributed.is_sharded(model):
        return model.state_dict() if distributed.is_main() else None
    main = distributed.is_main()
    weights = {name: t.cpu() for name, t in distributed.full_tensors(lora.merged_items(model))
               if main}
    return weights if main else None


def save_best(out_dir, model, start):
    """{out_dir}/best: a transformers model directory (a later stage's init_from) with
    start's tokenizer and generation config (and a LoRA model's adapter/), swapped in by
    one rename. Every rank calls it (a sharded model's weights are gathered); rank 0
    writes."""
    weights = whole_weights(model)
    adapted = lora.has_adapters(model)
    adapter = lora.peft_tensors(model) if adapted else None   # (gathered on every rank)
    if weights is None:
        return
    best, tmp = os.path.join(out_dir, "best"), os.path.join(out_dir, "best.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf_checkpoint(model, tmp, weights)
    if adapted:   # the merged model, and beside it the adapter in PEFT's format
        lora.save_peft_adapter(model, os.path.join(tmp, ADAPTER), model.lora_base["path"], adapter)
    save_tokenizer(start.tokenizer, tmp)
    save_generation_config(tmp, start.generation)
    shutil.rmtree(best, ignore_errors=True)
    os.replace(tmp, best)


def default_generation(tokenizer):
    """The generation config of a model with no generation_config.json: the tokenizer's
    stop ids (generation_stop_ids) and pad id."""
    return {"eos_token_id": list(generation_stop_ids(tokenizer)),
            "pad_token_id": tokenizer.pad_token_id}


def generation_config_of(path, tokenizer):
    """A model directory's generation_config.json as a dict, its eos_token_id a list of
    stop ids (one id or several: Llama 3 Instruct lists three; the tokenizer's when it
    names none). The other fields (a checkpoint's sampling defaults: temperature, top_p,
    ...) are kept as they are, so the checkpoints a stage writes carry them on."""
    try:
        with open(os.path.join(path, "generation_config.json")) as f:
            generation = json.load(f)
    except FileNotFoundError:
        return default_generation(tokenizer)
    except (OSError, ValueError) as e:
        raise ValueError(f"corrupt generation_config.json in {path!r}: {e}") from None
    if not isinstance(generation, dict):
        raise ValueError(f"generation_config.json in {path!r}: expected an object")
    eos = generation.get("eos_token_id")
    ids = [eos] if type(eos) is int else eos
    if ids is None or ids == []:
        ids = default_generation(tokenizer)["eos_token_id"]
    if not (isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)):
        raise ValueError(f"generation_config.json in {path!r}: eos_token_id={eos!r}, not id(s)")
    return {**generation, "eos_token_id": list(dict.fromkeys(ids))}


def stop_ids_of(path, tokenizer):
    """The stop ids of a model directory (generation_config_of's eos_token_id)."""
    return tuple(generation_config_of(path, tokenizer)["eos_token_id"])


def save_generation_config(path, generation):
    """Write generation_config.json into the directory path (a checkpoint being
    assembled)."""
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)


def file_digest(path):
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state():
    """python, numpy, torch (and CUDA) RNG states, in a form
    torch.load(weights_only=True) reads back."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            "numpy": (kind, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync(path):
    # POSIX: a file's bytes, or a directory's entries (renames), are durable once fsynced
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir, model, optimizer, tokenizer, iter_num, config, data_state=None,
                    extra=None, generation=None):
    """Write {out_dir}/ckpt atomically (see the top of this file). data_state must be
    JSON-serialisable, extra a RunState; generation is its generation_config.json
    (Start.generation; default the tokenizer's stop ids). Every rank calls it; rank 0
    writes. A sharded (FSDP2) model's weights are gathered to rank 0 one tensor at a time,
    and each rank writes its optimizer shards through torch.distributed.checkpoint into
    optimizer/ (read back on any world size: load_optimizer)."""
    final, tmp, old = (os.path.join(out_dir, n) for n in (CKPT, CKPT_TMP, CKPT_OLD))
    sharded, main = distributed.is_sharded(model), distributed.is_main()
    if not (main or sharded):
        return final
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    adapted, adapter = lora.has_adapters(model), None
    if sharded:
        # FSDP2 leaves the root's parameters gathered after a forward without backward
        # (an evaluation): shards again, the ones the optimizer knows
        model.reshard()
    weights = whole_weights(model)
    if sharded:
        distributed.barrier()   # tmp exists before any rank writes into it
        adapter = lora.peft_tensors(model) if adapted else None
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=os.path.join(tmp, OPTIMIZER))
    if not main:
        return final
    save_hf_checkpoint(model, tmp, weights)
    save_tokenizer(tokenizer, tmp)
    save_generation_config(tmp, default_generation(tokenizer) if generation is None else generation)
    torch.save({"optimizer": None if sharded else optimizer.state_dict(), "rng": rng_state()},
               os.path.join(tmp, TRAINER_STATE))
    if adapted:
        lora.save_peft_adapter(model, os.path.join(tmp, ADAPTER), model.lora_base["path"], adapter)
        _fsync(os.path.join(tmp, ADAPTER))
    files = {}
    for name in _files_under(tmp):
        _fsync(os.path.join(tmp, name))
        files[name] = {"size": os.path.getsize(os.path.join(tmp, name)),
                       "xxh64": file_digest(os.path.join(tmp, name))}
    meta = {"iter": iter_num, "config": config, "data_state": data_state,
            "extra": None if extra is None else asdict(extra),
            "files": files}
    if adapted:
        meta["lora"] = {**lora.spec_record(model.lora_spec), **model.lora_base}
    # the manifest last: its presence means the rest is whole
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1)
    _fsync(os.path.join(tmp, META))
    _fsync(tmp)
    if os.path.isdir(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def _files_under(path):
    """Every file under path, relative to it, sorted ('adapter/adapter_config.json')."""
    return sorted(os.path.relpath(os.path.join(root, name), path)
                  for root, _, names in os.walk(path) for name in names)


def clear_checkpoints(out_dir):
    """A fresh run's first act: remove an earlier run's checkpoints from out_dir, so
    that a later init_from='resume' finds this run's or none (never the earlier run's,
    which it would silently continue). Returns the names removed."""
    stale = [n for n in (CKPT, CKPT_OLD, CKPT_TMP) if os.path.exists(os.path.join(out_dir, n))]
    for name in stale:
        shutil.rmtree(os.path.join(out_dir, name))
    return stale


def find_checkpoint(out_dir):
    """The checkpoint directory to resume from in out_dir (ckpt, else ckpt.old), or None."""
    for name in (CKPT, CKPT_OLD):
        path = os.path.join(out_dir, name)
        if os.path.isfile(os.path.join(path, META)):
            return path
    return None


def read_checkpoint_meta(path):
    """checkpoint.json of a checkpoint dir, after checking every file it lists is there,
    whole and unchanged."""
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
        files, it = meta["files"], meta["iter"]
    except FileNotFoundError:
        raise ValueError(f"missing checkpoint: no {META} in {path!r}") from None
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt checkpoint {path!r}: unreadable {META} ({e!r})") from None
    if type(it) is not int or it < 0 or not isinstance(files, dict):
        raise ValueError(f"corrupt checkpoint {path!r}: bad {META} (iter={it!r})")
    for name, info in files.items():
        fpath = os.path.join(path, name)
        intact = (os.path.isfile(fpath) and os.path.getsize(fpath) == info["size"]
                  and file_digest(fpath) == info["xxh64"])
        if not intact:
            raise ValueError(f"corrupt checkpoint {path!r}: {name} missing, truncated or modified")
    return meta


def model_dir_of(path):
    """init_from=path accepts a previous stage's out_dir (its ckpt, or ckpt.old) or a
    transformers model dir."""
    require(isinstance(path, str) and os.path.isdir(path),
            f"init_from={path!r}: expected scratch, resume or an existing directory (a "
            "previous stage's out_dir: run that stage first, e.g. pretrain.py then sft.py "
            "with the same config, or `bash speedrun.sh`)")
    found = find_checkpoint(path)
    if found:
        return found
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    raise ValueError(f"init_from={path!r}: neither a run directory ({CKPT}/) nor a model one "
                     f"(config.json)")


def load_model(path):
    """The fp32 master weights of a model directory, on cpu (a missing file is a
    ValueError, like a corrupt one)."""
    try:
        return load_hf_checkpoint(path, device="cpu", dtype=torch.float32)
    except FileNotFoundError as e:
        raise ValueError(f"missing checkpoint files in {path!r}: {e}") from None


def load_optimizer(model, optimizer, start):
    """A resumed run's optimizer state into optimizer, on this run's world size: shards
    saved through torch.distributed.checkpoint (optimizer/) are read into whatever layout
    model has now, sharded or whole; a whole state (trainer_state.pt) loads into a whole
    model as it is and into a sharded one by parameter name."""
    shards = os.path.join(start.source, OPTIMIZER)
    if os.path.isdir(shards):
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=shards)
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    elif distributed.is_sharded(model):
        set_optimizer_state_dict(model, optimizer, by_name(start.trainer_state["optimizer"],
                                                           model, optimizer),
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(start.trainer_state["optimizer"])


def by_name(state, model, optimizer):
    """An optimizer state_dict keyed by parameter index (torch's) -> keyed by parameter
    name (torch.distributed.checkpoint's), the indices counted over optimizer's groups
    in order: {"state": {0: ...}} -> {"state": {"embed_tokens.weight": ...}}."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {"state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]}
                             for g in state["param_groups"]]}


def load_trainer_state(path):
    """The optimizer and RNG states of a training checkpoint."""
    try:
        state = torch.load(os.path.join(path, TRAINER_STATE), map_location="cpu",
                           weights_only=True)
    except Exception as e:  # pickle/zip errors of all kinds mean one thing here
        raise ValueError(f"corrupt checkpoint {path!r}: {TRAINER_STATE}: {e!r}") from None
    if not isinstance(state, dict) or not {"optimizer", "rng"} <= set(state):
        raise ValueError(f"corrupt checkpoint {path!r}: {TRAINER_STATE} lacks optimizer/rng")
    return state


# -----------------------------------------------------------------------------
# where a run starts: a fresh model, a previous stage's weights, or a killed run's
# checkpoint


@dataclass(frozen=True)
class RunState:
    """What a trainer keeps of its run in a checkpoint beyond weights, optimizer, RNG and
    data state (checkpoint.json's "extra"), read back on resume."""
    meter: dict | None = None     # training.Meter.state_dict(): FLOPs and seconds spent
    weight_version: int = 0       # GRPO: the rollout engine's weight version
    best: dict | None = None      # GRPO keep_best: {"accuracy", "iter"} of the best evaluation


@dataclass(frozen=True)
class Start:
    """What a run starts from: the model (fp32 master weights, on cpu), its tokenizer and
    generation config (generation_config_of: its stop ids end every stage's episodes,
    and the checkpoints a stage writes keep all of it); when resuming, the checkpoint's
    verified checkpoint.json (iteration, data state, extra) and trainer state
    (optimizer + RNG)."""
    model: Transformer
    tokenizer: object
    generation: dict
    meta: dict | None = None
    trainer_state: dict | None = None
    source: str = "scratch"

    @property
    def iter_num(self):
        return 0 if self.meta is None else self.meta["iter"]

    @property
    def run_state(self) -> RunState:
        """The resumed run's RunState; a fresh run's is RunState()."""
        extra = (self.meta or {}).get("extra") or {}
        return RunState(**{f.name: extra[f.name] for f in fields(RunState) if f.name in extra})

    @property
    def stop_ids(self):
        return tuple(self.generation["eos_token_id"])


def init_start(config, new_tokenizer):
    """Where the run starts, per config['init_from']:
      'scratch'   a fresh model shaped by config['model'] (vocab from new_tokenizer()), iteration 0
      'resume'    {out_dir}/ckpt: weights, optimizer, RNG, iteration, data state
      a path      a previous stage's out_dir or a transformers model dir: weights (and its
                  tokenizer), iteration 0. A transformers dir without a tokenizer gets
                  new_tokenizer() if its vocabulary fits.
    With lora_rank > 0 the model carries the run's LoRA adapters (with_lora)."""
    return with_lora(config, _start(config, new_tokenizer))


def with_lora(config, start):
    """start's model with the LoRA adapters config asks for (lora.spec_of): fresh ones on
    a new run's model (its base: start.source, and a digest of it), or a resumed run's
    rebuilt exactly: its base reloaded (the digest checked) and the checkpoint's adapter
    copied in. LoRA settings that differ from the resumed run's are refused."""
    spec, saved = lora.spec_of(config), (start.meta or {}).get("lora")
    if start.meta is not None:
        was = lora.spec_from_record(saved)
        flags = "no LoRA (lora_rank=0)" if was is None else (
            f"--lora_rank={was.rank} --lora_alpha={was.alpha} "
            f"--lora_targets={','.join(was.targets)}")
        require(spec == was, f"init_from='resume' with lora_rank={config.get('lora_rank', 0)}, "
                             f"lora_alpha={config.get('lora_alpha')}, lora_targets="
                             f"{config.get('lora_targets')!r}: the run being resumed had {flags}; "
                             f"resume with the same")
    if spec is None:
        return start
    require(config["init_from"] != "scratch",
            "lora_rank > 0 with init_from='scratch': LoRA adapts a trained model, start from one")
    if saved is None:
        model, base = start.model, {"path": os.path.abspath(start.source)}
    else:   # the merged model goes before the base comes: one model in memory at a time
        start = replace(start, model=None)
        model, base = load_model(saved["path"]), {"path": saved["path"]}
    lora.check_peft_can_hold(model, spec)   # its checkpoints keep the adapter in PEFT's form
    base["digest"] = lora.base_digest(model)
    if saved is not None and base["digest"] != saved["digest"]:
        raise ValueError(f"init_from='resume': the LoRA run's base {saved['path']!r} changed since "
                         f"the run started (digest {base['digest']}, was {saved['digest']})")
    lora.add_lora(model, spec, seed=config["seed"])
    model.lora_base = base
    if saved is not None:
        lora.load_peft_adapter(model, os.path.join(start.source, ADAPTER))
    return replace(start, model=model)


def _start(config, new_tokenizer):
    init_from = config["init_from"]
    if init_from == "scratch":
        tokenizer = new_tokenizer()
        model_config = _model_config(config["model"], tokenizer)
        # the initial weights are a function of the seed alone
        torch.manual_seed(config["seed"])
        return Start(Transformer(model_config), tokenizer, default_generation(tokenizer))
    if init_from == "resume":
        out_dir = config["out_dir"]
        path = find_checkpoint(out_dir)
        if path is None:
            raise ValueError(f"init_from='resume': no checkpoint in out_dir={out_dir!r} ({CKPT}/)")
        meta, tokenizer = read_checkpoint_meta(path), load_tokenizer(path)
        report_changed_settings(config, meta["config"])
        return Start(load_model(path), tokenizer, generation_config_of(path, tokenizer), meta,
                     load_trainer_state(path), source=path)
    path = model_dir_of(init_from)
    if os.path.isfile(os.path.join(path, META)):
        # a previous stage's checkpoint is verified before it is trusted
        read_checkpoint_meta(path)
    model = load_model(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        tokenizer = load_tokenizer(path)
        return Start(model, tokenizer, generation_config_of(path, tokenizer), source=path)
    tokenizer = new_tokenizer()
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"init_from={init_from!r} has no tokenizer, and its vocab_size="
                         f"{model.config.vocab_size} is below the embedded one's {len(tokenizer)}")
    print0(f"init_from={init_from!r} has no tokenizer: using the embedded one ({len(tokenizer)} "
           f"ids)")
    return Start(model, tokenizer, default_generation(tokenizer), source=path)


def report_changed_settings(config, saved):
    """A resumed run takes its settings from this command line, not the checkpoint's:
    say which differ (a changed grad_accum or lr is a different run from here on), and
    which of the checkpoint's this script does not read (a train_grpo_async.py run
    resumed by train_grpo.py: its corrections are off from here on)."""
    changed = {k: (saved[k], v) for k, v in config.items()
               if k in saved and k != "init_from" and saved[k] != v}
    for key, (was, now) in changed.items():
        print0(f"resume: {key} = {now!r} (the checkpoint's run had {was!r})")
    unread = [f"{k}={v!r}" for k, v in saved.items() if k not in config]
    if unread:
        print0(f"resume: the checkpoint's run had settings this script does not read, off "
               f"from here on: {', '.join(unread)}")
    return changed


def _model_config(model_kw, tokenizer):
    # config['model'] over what the tokenizer fixes (vocab size, eos, pad)
    unknown = sorted(set(model_kw) - {f.name for f in fields(ModelConfig)})
    if unknown:
        raise ValueError(f"model: unknown ModelConfig field(s) {unknown}")
    kw = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
          "pad_token_id": tokenizer.pad_token_id, **model_kw}
    vocab = kw["vocab_size"]
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer's {len(tokenizer)}")
    try:
        return ModelConfig(**kw)
    except TypeError as e:
        raise TypeError(f"model: {e}") from None
