"""
LoRA: a trainable low-rank update beside every weight the forward reads, the base frozen.

    import lora
    lora.add_lora(model, lora.LoRASpec(rank=8, alpha=16, targets=lora.parse_targets("all")))
    # train: only the adapters have requires_grad (no gradient or AdamW state for the base)
    engine = InferenceEngine(EngineConfig(), model=model)   # shares the frozen base
    engine.update_weights(lora.adapter_state(model))        # after a step: the adapters only
    save_hf_checkpoint(model, "out/merged")     # a plain transformers model of the merged weights
    lora.save_peft_adapter(model, "out/adapter", base="out/sft/best")
    # peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")

Each targeted weight W ([out, in], or a stack of E experts [E, out, in]) gets a
model.LoRA beside it, A [.., rank, in] and B [.., out, rank], and the layer reads
x W^T + (alpha / rank) (x A^T) B^T: model.py's Linear (q, k, v, o and the dense MLP;
Attention runs q, k and v apart once they have adapters, where it would fuse them) and
Experts (both fused stacks, one adapter per expert) apply it in the forward, so no
weight is silently left out, as wrapping modules would leave q, k and v out (model.py
reads them as tensors), and the backward keeps nothing of W's size. A starts as peft's
(Kaiming-uniform) and B at zero, so a fresh adapter changes nothing.

A LoRA model's state_dict() is its merged weights W + scale B @ A under the base names
(a hook below): what every reader of a model's whole weights wants (checkpoints, weight
sync to rollout ranks and servers, the in-sync check), so none of them knows about LoRA.
An engine on the same device and dtype shares the frozen base instead (sharing_base:
no copy of the weights, as vLLM serves LoRA) and takes adapter_state after each step.
The adapters themselves are adapters(model); a training checkpoint keeps them in PEFT's
format beside the merged model, and resume rebuilds base + adapters exactly from the
run's base (its digest checked).

What it leaves out: dropout on the adapters (RL runs use none), the embedding and the
head as targets, rsLoRA / DoRA, and several adapters at once.
"""

import copy
import json
import math
import os
from dataclasses import asdict, dataclass

import torch
from torch.distributed.tensor import DTensor

from checks import require
from model import Experts, Linear, LoRA, Transformer
from scaleout import distributed

# what lora_targets may name: the attention projections, the dense MLP's three linears,
# and 'experts' (both fused expert tensors of every MoE layer)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "experts")
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    rank: int
    alpha: float
    targets: tuple          # names from TARGETS

    @property
    def scale(self):
        return self.alpha / self.rank


def parse_targets(text):
    """'all' or comma-separated names of TARGETS -> a tuple of them, in TARGETS' order."""
    names = TARGETS if text == "all" else tuple(n.strip() for n in str(text).split(","))
    unknown = [n for n in names if n not in TARGETS]
    require(not unknown and names,
            f"lora_targets={text!r}: unknown {unknown}; expected 'all' or names from {TARGETS}")
    return tuple(n for n in TARGETS if n in names)


def spec_of(config):
    """The LoRASpec a run's settings ask for (lora_rank, lora_alpha, lora_targets), or
    None when lora_rank = 0; each bad value refused naming it."""
    rank, alpha = config.get("lora_rank", 0), config.get("lora_alpha", 0.0)
    require(type(rank) is int and rank >= 0, f"lora_rank={rank!r}: expected an int >= 0")
    if rank == 0:
        return None
    ok = type(alpha) in (int, float) and math.isfinite(alpha) and alpha > 0
    require(ok, f"lora_alpha={alpha!r}: expected a number > 0")
    return LoRASpec(rank, float(alpha), parse_targets(config["lora_targets"]))


# -----------------------------------------------------------------------------
# adapters on a model


def targeted(model, targets):
    """(module path, module, weight name) of every weight the targets name: model.Linear
    layers named like a target (the router, 'gate', and the head are not), and both
    fused tensors of each Experts."""
    for path, module in model.named_modules():
        if isinstance(module, Linear) and path.rsplit(".", 1)[-1] in targets:
            yield path, module, "weight"
        elif isinstance(module, Experts) and "experts" in targets:
            yield path, module, "gate_up_proj"
            yield path, module, "down_proj"


def add_lora(model: Transformer, spec: LoRASpec, seed=0):
    """Freeze model and give each targeted weight an adapter (module.{name}_lora), in
    place (A's init from its own generator: the run's RNG stream is untouched). Returns
    model."""
    require(not has_adapters(model), "add_lora: the model already has adapters")
    found = list(targeted(model, spec.targets))
    present = [t for t in TARGETS if list(targeted(model, (t,)))]
    require(found, f"lora_targets={','.join(spec.targets)!r}: no such weight in this model; "
                   f"it has {','.join(present)}")
    model.requires_grad_(False)   # (only once nothing is refused)
    generator = torch.Generator().manual_seed(seed)
    for _, module, name in found:
        weight = getattr(module, name)
        adapter = LoRA(weight.shape, spec.rank, spec.scale)
        # peft's init: nn.Linear's Kaiming-uniform on each [rank, in] (bound 1 / sqrt(in))
        bound = 1 / math.sqrt(weight.shape[-1])
        with torch.no_grad():
            adapter.A.copy_(torch.rand(adapter.A.shape, generator=generator) * 2 * bound - bound)
        setattr(module, name + "_lora", adapter.to(weight.device, weight.dtype))
    model.lora_spec = spec
    model.register_state_dict_post_hook(_merged_state_dict)
    return model


def has_adapters(model):
    return getattr(model, "lora_spec", None) is not None


def adapters(model):
    """{'{path}.{weight name}': model.LoRA} of every adapted weight, in the model's order."""
    return {f"{path}.{name}": getattr(module, name + "_lora")
            for path, module, name in targeted(model, model.lora_spec.targets)}


def _merged_state_dict(model, state, prefix, local_metadata):
    # each adapted weight W -> W + scale B @ A under its own name; the adapters' keys
    # ('{weight key}_lora.A', '..._lora.B') dropped
    with torch.no_grad():
        for key, adapter in adapters(model).items():
            state[prefix + key] = state[prefix + key] + adapter.delta().detach()
    for key in [k for k in state if is_adapter_key(k)]:
        del state[key]


def merged_items(model):
    """(name, weight) of the state_dict's entries one at a time, a LoRA model's merged
    as they come (W + scale B @ A, shard by shard when sharded): what the state_dict
    holds, never all of the merged weights at once."""
    if not has_adapters(model):
        yield from model.state_dict().items()
        return
    by_weight = adapters(model)
    with torch.no_grad():
        for name, t in base_weights(model).items():
            yield name, (t + by_weight[name].delta() if name in by_weight else t).detach()


def is_adapter_key(key):
    return key.endswith(("_lora.A", "_lora.B"))


def adapter_state(model):
    """{'{weight key}_lora.A' / '_lora.B': tensor}: what an engine sharing the base
    (sharing_base) takes after each step, in place of the whole state_dict."""
    out = {}
    for key, adapter in adapters(model).items():
        out[f"{key}_lora.A"], out[f"{key}_lora.B"] = adapter.A.detach(), adapter.B.detach()
    return out


def sharing_base(model):
    """An engine's model that reads model's frozen base tensors themselves (no copy) and
    holds its own copy of the adapters (its state_dict: the base and the adapters, no
    merge). For a LoRA model that is not sharded, on the engine's device and dtype."""
    with torch.device("meta"):
        view = Transformer(model.config)
    # assign: the base's own storage, in new (frozen) Parameters
    view.load_state_dict({k: t.detach() for k, t in base_weights(model).items()},
                         assign=True, strict=True)
    for key, adapter in adapters(model).items():
        path, name = key.rsplit(".", 1)
        setattr(view.get_submodule(path), name + "_lora", copy.deepcopy(adapter))
    return view.requires_grad_(False)


def base_weights(model):
    """The frozen base tensors, under their names (the merged state_dict hides them)."""
    return {k: t for k, t in model.named_parameters() if not is_adapter_key(k)}


def base_digest(model):
    """xxh64 of every base tensor's bytes, in name order: what a resumed run checks its
    base against."""
    return distributed.digest(sorted(base_weights(model).items()))


# -----------------------------------------------------------------------------
# PEFT's folder format: adapter_config.json + adapter_model.safetensors
#
# peft names an nn.Linear's adapter after its module (lora_A.weight [r, in], lora_B.weight
# [out, r]) and fused experts' adapters after the Experts module through its
# target_parameters: gate_up_proj's wrapper is the inner one (its keys have
# '.base_layer.'), down_proj's the outer; their A is [E * r, in] (expert-major) and their
# B [out, r * E] (rank-major): expert e's B is B[:, e::E]. Worked example, E = 2, r = 1:
# our A [2, 1, in] -> rows [A_0; A_1]; our B [2, out, 1] -> columns [B_0, B_1].


def peft_stem(key):
    """peft's key prefix of our adapted weight key ('layers.0.mlp.experts.down_proj')."""
    path, name = key.rsplit(".", 1)
    inner = "base_layer." if name == "gate_up_proj" else ""
    return f"base_model.model.model.{path}.{inner}"


def peft_tensors(model):
    """Our adapters -> {peft key: tensor} (the saved names, no adapter name); a sharded
    model's gathered, every rank taking part."""
    out = {}
    for key, adapter in adapters(model).items():
        A, B = (t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
                for t in (adapter.A, adapter.B))
        stem = peft_stem(key)
        if A.dim() == 3:
            E, r = A.shape[:2]
            A, B = A.reshape(E * r, -1), B.permute(1, 2, 0).reshape(B.shape[1], r * E)
        out[stem + "lora_A.weight"], out[stem + "lora_B.weight"] = A, B
    return out


def load_peft_tensors(model, tensors):
    """peft_tensors' inverse: copy a saved adapter's tensors into model's adapters
    (names and shapes checked first, as from outside)."""
    ours = {}
    for key, adapter in adapters(model).items():
        stem = peft_stem(key)
        ours[stem + "lora_A.weight"], ours[stem + "lora_B.weight"] = adapter.A, adapter.B
    missing, unknown = sorted(set(ours) - set(tensors)), sorted(set(tensors) - set(ours))
    require(not missing and not unknown, f"adapter: missing {missing[:3]}, unknown {unknown[:3]}")
    with torch.no_grad():
        for key, target in ours.items():
            t = tensors[key]
            if target.dim() == 3:   # [E*r, in] / [out, r*E] -> [E, r, in] / [E, out, r]
                E, a, b = target.shape
                t = t.reshape(E, a, b) if "lora_A" in key else t.reshape(a, b, E).permute(2, 0, 1)
            require(tuple(t.shape) == tuple(target.shape),
                    f"adapter {key}: shape {tuple(t.shape)}, not {tuple(target.shape)}")
            target.copy_(t)


def check_peft_can_hold(model, spec):
    """The linear targets spec finds in model, once it is clear a PEFT adapter can hold
    them: peft 0.21 maps a qwen3_moe model's gate_proj / up_proj / down_proj targets to its
    experts, so the dense layers of a MoE model (mlp_only_layers, decoder_sparse_step)
    cannot be adapted. Refused naming the targets to drop."""
    found = {p.rsplit(".", 1)[-1] for p, _, name in targeted(model, spec.targets)
             if name == "weight"}
    dense_in_moe = found & {"gate_proj", "up_proj", "down_proj"} if model.config.num_experts \
        else set()
    require(not dense_in_moe, f"lora_targets={','.join(spec.targets)!r}: this MoE model's dense "
                              f"layers' {sorted(dense_in_moe)} cannot go into a PEFT adapter "
                              f"(peft maps them to the experts); leave them out")
    return found


def save_peft_adapter(model, path, base=None, tensors=None):
    """Write model's adapters as a PEFT LoRA folder (each file atomically), for
    peft.PeftModel.from_pretrained on the base checkpoint (`base`, recorded as
    base_model_name_or_path); tensors: peft_tensors(model), when already gathered. What
    peft cannot hold is refused (check_peft_can_hold)."""
    from safetensors.torch import save_file
    spec, cfg = model.lora_spec, model.config
    found = check_peft_can_hold(model, spec)
    experts = "experts" in spec.targets and cfg.num_experts > 0
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank,
              "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "init_lora_weights": True, "base_model_name_or_path": base,
              "target_modules": [t for t in TARGETS if t in found],
              "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
              if experts else None}
    os.makedirs(path, exist_ok=True)
    tensors = peft_tensors(model) if tensors is None else tensors
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS) + ".tmp", metadata={"format": "pt"})
    os.replace(os.path.join(path, ADAPTER_WEIGHTS) + ".tmp", os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG) + ".tmp", "w") as f:
        json.dump(config, f, indent=2)
    os.replace(os.path.join(path, ADAPTER_CONFIG) + ".tmp", os.path.join(path, ADAPTER_CONFIG))


def load_peft_adapter(model, path):
    """Copy a saved PEFT LoRA folder's tensors into model's adapters (the same spec)."""
    from safetensors.torch import load_file
    load_peft_tensors(model, load_file(os.path.join(path, ADAPTER_WEIGHTS)))


def spec_record(spec):
    """A spec as the checkpoint's JSON holds it (and compares it on resume)."""
    return {**asdict(spec), "targets": list(spec.targets)}


def spec_from_record(record):
    """spec_record's inverse (None: no LoRA)."""
    if record is None:
        return None
    return LoRASpec(record["rank"], record["alpha"], tuple(record["targets"]))
