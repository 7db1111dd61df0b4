"""
Off-policy corrections: what to do when the tokens were sampled by a policy (the engine's)
other than the one being trained (the trainer's). Here the two share model.py and agree to
about 1e-7 in fp32, so every mismatch is one we put in on purpose, and each correction can
be measured against the exact on-policy gradient (bench/off_policy_lab.py). The sources a
setting turns on (train_grpo.py): engine_dtype='bfloat16' (rounding, and for an MoE model
other experts), max_staleness (older weights), top_p / top_k (a truncated distribution:
the engine's logprob is the truncated one's).

Per sampled token t of a sample, with r_t = exp(log p_trainer(t) - log p_engine(t)):

    token level     ratio_t = r_t
    sequence level  ratio_t = exp(mean over the sample's sampled tokens of log r)   (GSPO's
                    geometric mean: one ratio for every token of the sample)
    TIS             weight *= min(ratio, cap)                       (truncated IS; tis_cap)
    masked IS       weight *= ratio if lo <= ratio <= hi, else 0    (mis_low, mis_high)
    PPO clip        loss = -sum min(q A, clip(q, 1 - eps, 1 + eps) A) / normalizer, with
                    q = exp(log p_now - log p_old), log p_old the trainer's before the step's
                    first epoch (ppo_clip = eps, ppo_epochs steps on the same rollout)
    routing replay  an MoE trainer routes each token to the experts the engine used
                    (EngineConfig.record_routes, model.py's routes=)

The IS factors are constants (no gradient), folded into the token weights of the shared
loss; PPO's ratio carries the gradient. With no mismatch every ratio is 1 (to rounding),
and every correction leaves the gradient as it was; so does PPO's first epoch.

What every run logs: offpolicy/entropy (mean -log p_engine over the sampled tokens: the
behaviour policy's entropy, estimated on its own samples), offpolicy/kl_k3 (the k3
estimate of KL(engine || trainer), mean of r - 1 - log r), offpolicy/corrected (the
share of sampled tokens whose IS factor was truncated or masked), offpolicy/ppo_clipped
(the share PPO's clip held back) and, with routes recorded,
offpolicy/expert_disagreement (the share of (token, MoE layer) pairs whose experts
differ between engine and trainer).
"""

import torch


def sample_ids(batch):
    """Per row of a PackedBatch, which sample it belongs to: its document and (a group
    packed with its prompt shared, training.pack_groups) its branch. Rows of a branch-0
    prompt get their document's branch-0 id; they carry no loss weight."""
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    if batch.branch is None:
        return doc
    return doc * (int(batch.branch.max()) + 1) + batch.branch


def importance_ratios(trainer_lp, engine_lp, mask, ids=None):
    """ratio per row [T]: r = exp(trainer - engine) on the masked rows, 1 elsewhere;
    with ids (the rows' samples), the sample's geometric mean ratio on each of its rows.
    Worked example: one sample, log r = [0.2, -0.4, 0.5] -> mean 0.1, every row
    exp(0.1) = 1.105."""
    log_r = torch.where(mask, trainer_lp - engine_lp, 0.0)
    if ids is None:
        return torch.where(mask, log_r.exp(), 1.0)
    n = int(ids.max()) + 1
    zeros = torch.zeros(n, dtype=log_r.dtype, device=log_r.device)
    sums = zeros.index_add(0, ids, log_r)
    counts = zeros.index_add(0, ids, mask.to(log_r.dtype))
    mean = sums / counts.clamp(min=1)
    return torch.where(mask, mean[ids].exp(), 1.0)


def truncated(ratio, cap):
    """TIS's factor: min(ratio, cap)."""
    return ratio.clamp(max=cap)


def masked(ratio, low, high):
    """Masked IS's factor: the ratio where low <= ratio <= high, else 0 (the
    token drops out)."""
    return torch.where((ratio >= low) & (ratio <= high), ratio, 0.0)


def is_factor(ratio, config):
    """The factor the configured correction folds into the weights, and which rows it
    changed (the ratio truncated or masked): (factor [T], changed [T] bool)."""
    if config["tis_cap"] > 0:
        factor = truncated(ratio, config["tis_cap"])
    elif config["mis_high"] > 0:
        factor = masked(ratio, config["mis_low"], config["mis_high"])
    else:
        return torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    return factor, factor != ratio


def ppo_loss(logp, old_logp, weights, mask, clip, normalizer):
    """PPO's clipped objective on the token weights (advantage x IS factor): -(sum over
    masked rows of min(q w, clip(q, 1 - clip, 1 + clip) w)) / normalizer, q = exp(logp -
    old_logp). Returns (loss, how many masked rows the clip held back: those where the
    clipped term is the smaller)."""
    q = torch.exp(logp - old_logp)
    w = weights.detach().to(logp.dtype)
    plain, held = q * w, q.clamp(1 - clip, 1 + clip) * w
    objective = torch.where(mask, torch.minimum(plain, held), 0.0)
    clipped = mask & (held < plain)
    return -objective.sum() / normalizer, int(clipped.sum())


def kl_k3(trainer_lp, engine_lp, mask):
    """sum over masked rows of r - 1 - log r, r = exp(trainer - engine): k3's estimate of
    KL(engine || trainer) times the number of rows (each term >= 0)."""
    d = torch.where(mask, trainer_lp - engine_lp, 0.0).double()
    return float((d.exp() - 1 - d).sum())


def expert_disagreement(used, engine_routes, mask):
    """(pairs whose expert sets differ, pairs compared) over the masked rows and every
    MoE layer: used [T, M, k] the trainer's experts, engine_routes [T, M, k] the
    engine's (-1: none)."""
    have = mask & (engine_routes[:, 0, 0] >= 0)
    a, b = used[have].sort(-1).values, engine_routes[have].long().sort(-1).values
    differ = (a != b).any(-1)
    return int(differ.sum()), differ.numel()
