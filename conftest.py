"""
Shared test fixtures. The reference for correctness is always transformers: tests build random tiny checkpoints
with transformers itself (its own classes, its own save_pretrained) and compare our code against them.
"""

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM


def randomise(hf_model, seed=0):
    """Perturb every parameter: all-zero routers and all-one norms hide bugs (a wrong norm or router path
    still "matches")."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif "mlp.gate.weight" in name or name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf_model.eval()


def write_hf_checkpoint(hf_config, path, seed=0):
    """(hf_model, path): a randomised transformers model of hf_config (Qwen3 or Qwen3-MoE), written to path by
    transformers' own save_pretrained."""
    torch.manual_seed(seed)
    cls = Qwen3ForCausalLM if hf_config.model_type == "qwen3" else Qwen3MoeForCausalLM
    hf = randomise(cls(hf_config), seed)
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def one_thread():
    # tiny models gain nothing from a second thread, and on a shared 2-core machine an oversubscribed OpenMP
    # pool makes each small op far slower
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
