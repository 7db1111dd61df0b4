r"""
GRPO with its rollouts sampled anywhere, by weights possibly older than the trainer's:
train_grpo.py forked, importing its parts (advantages, the sampler, rollout, packing, the
normalizer, evaluation) and adding what it leaves out. Read train_grpo.py first.

    # rank 1 only samples, a step ahead of rank 0's training (scaleout/rollout_ranks.py)
    torchrun --standalone --nproc_per_node=2 train_grpo_async.py config/qwen_small.py \
        --rollout_ranks=1 --max_staleness=1 --tis_cap=2
    # scaleout/serve.py (or vLLM) servers sample (scaleout/rollout_servers.py)
    python train_grpo_async.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8000
    # a verifiers environment's episodes, against those servers (scaleout/verifiers_groups.py)
    python train_grpo_async.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8000 \
        --verifiers_cmd="/tmp/vf_venv/bin/python scaleout/verifiers_countdown.py"
    # colocated as train_grpo.py, with a bf16 engine and truncated IS (docs/off_policy.md)
    python train_grpo_async.py config/qwen_small.py --engine_dtype=bfloat16 --tis_cap=2

What it adds to train_grpo.py's iteration (grpo_step below; the numbers are that
step's phases, and phase 2, the advantages and the packing, is the same):
  1. the groups come from a source: this process's engine (Colocated), rollout ranks or
     servers; with max_staleness = s, rollout j samples with the weights after step j - s;
  3. a logprob pass of the trainer's weights before the step, when a setting needs one,
     folds an importance-sampling factor into the token weights (tis_cap, or mis_low /
     mis_high; is_level) and subtracts the KL to the starting policy (kl_coef); it also
     gives PPO its old logprobs and compares the engine's experts with the trainer's
     (record_routes; routing_replay routes the trainer by them);
  4. ppo_epochs optimizer steps, on PPO's clipped objective with ppo_clip > 0;
  5. the source publishes the new weights: in place, by broadcast to the rollout ranks,
     or to the servers' weight-transfer API.

A source has this interface (Colocated here; rollout_ranks.RolloutRanks and
rollout_servers.Servers):

    groups(it) -> (groups, flops, metrics)   iteration it's kept groups
                                             ([tasks.environment.Group]), what sampling
                                             them cost, the rollout metrics
    publish(model, it) -> metrics            hand model's new weights to whatever samples
    eval_engine(model) -> engine             an engine holding model's weights
    data_state() -> dict                     the sampler's record, for a checkpoint
    version                                  the trainer's weight version (checkpointed)
"""
import dataclasses
import functools
import shlex
import time

import torch

import train_grpo
import training
from checkpoint import RunState, init_start, load_model, model_dir_of
from checks import BadValue, require
from configurator import print0, run_cli, settings_of
from scaleout import distributed, verifiers_groups
from scaleout.rollout_ranks import RolloutRanks, run_worker
from scaleout.rollout_servers import Servers
from tasks.environment import load_task
from tokenizer import build_tokenizer

# -----------------------------------------------------------------------------
# settings: every one of train_grpo.py's (its block; the same config files), then these
globals().update(settings_of(vars(train_grpo)))
kl_coef = 0.0                 # > 0: weights -= kl_coef * (log p - log p_start)
# off-policy corrections, ratio = exp(trainer - engine logprob) per token
tis_cap = 0.0                 # > 0: weights *= min(ratio, tis_cap) (truncated IS)
mis_low = 0.0                 # with mis_high > 0: weights *= ratio inside [mis_low, mis_high],
mis_high = 0.0                # 0 outside (masked IS)
is_level = "token"            # 'sequence': the ratio is the sample's geometric mean (GSPO)
ppo_clip = 0.0                # > 0: PPO's clipped objective, ratio to the trainer before the step
ppo_epochs = 1                # optimizer steps per rollout (> 1 with ppo_clip > 0)
record_routes = False         # MoE: the engine records each token's experts (a metric)
routing_replay = False        # MoE: ... and the trainer routes each token by them
# where the rollouts come from (colocated when neither is set)
rollout_ranks = 0             # torchrun: the last K ranks only sample, the others train
max_staleness = 0             # rollout j samples with the weights of step j - s
weight_bucket_mb = 64.0       # bucket size of the weight broadcast
rollout_urls = ""             # 'http://host:port[,...]': servers sample
rollout_api_key = ""          # the servers' --api_key
weight_master_address = "127.0.0.1"   # where the servers reach the trainer's weight group
weight_backend = "gloo"       # the weight group's backend: 'gloo', or 'nccl' on cuda
verifiers_cmd = ""            # a verifiers environment's episodes sample instead of the
                              # task's: scaleout/verifiers_groups.py
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# off-policy corrections: for tokens sampled by a policy (the engine's) other than the
# one being trained (the trainer's). The sources a setting turns on:
# engine_dtype='bfloat16' (rounding, and for an MoE model other experts), max_staleness
# (older weights), top_p / top_k (a truncated distribution: the engine's logprob is the
# truncated one's). docs/off_policy.md measures what each buys, and lists what a run logs.
#
# Per sampled token t of a sample, with r_t = exp(log p_trainer(t) - log p_engine(t)):
#
#     token level     ratio_t = r_t
#     sequence level  ratio_t = exp(mean over the sample's sampled tokens of log r)   (GSPO's
#                     geometric mean: one ratio for every token of the sample)
#     TIS             weight *= min(ratio, cap)                       (truncated IS; tis_cap)
#     masked IS       weight *= ratio if lo <= ratio <= hi, else 0    (mis_low, mis_high)
#     PPO clip        loss = -sum min(q A, clip(q, 1 - eps, 1 + eps) A) / normalizer, with
#                     q = exp(log p_now - log p_old), log p_old the trainer's before the step's
#                     first epoch (ppo_clip = eps, ppo_epochs steps on the same rollout)
#     routing replay  an MoE trainer routes each token to the experts the engine used
#                     (EngineConfig.record_routes, model.py's routes=)
#
# The IS factors are constants (no gradient), folded into the token weights of the shared
# loss; PPO's ratio carries the gradient. With no mismatch every ratio is 1 (to rounding),
# and every correction leaves the gradient as it was; so does PPO's first epoch.


def sample_ids(batch):
    """Per row of a PackedBatch, which sample it belongs to: its document and (a group
    packed with its prompt shared, pack_groups) its branch. Rows of a branch-0
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


def is_factor(ratio, tis_cap, mis_low, mis_high):
    """The factor the configured correction (tis_cap > 0, or mis_high > 0, or neither)
    folds into the weights, and which rows it changed (the ratio truncated or masked):
    (factor [T], changed [T] bool)."""
    if tis_cap > 0:
        factor = truncated(ratio, tis_cap)
    elif mis_high > 0:
        factor = masked(ratio, mis_low, mis_high)
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


def expert_disagreement(used, engine_routes, mask):
    """(pairs whose expert sets differ, pairs compared) over the masked rows and every
    MoE layer: used [T, M, k] the trainer's experts, engine_routes [T, M, k] the
    engine's (-1: none)."""
    have = mask & (engine_routes[:, 0, 0] >= 0)
    a, b = used[have].sort(-1).values, engine_routes[have].long().sort(-1).values
    differ = (a != b).any(-1)
    return int(differ.sum()), differ.numel()


# -----------------------------------------------------------------------------
# the step's batches and its objective


def document_routes(prompt, samples):
    """The engine's experts for each row of a pack_groups document: row p of the prompt,
    then per sample its rows from the prompt's last token on, and -1 (route yourself) on
    its last row, whose token the engine never computed. A sample's routes cover
    positions 0 .. P + C - 2."""
    n, shape = len(prompt) - 1, samples[0].routes.shape[1:]
    rows = [samples[0].routes[:n].long()]
    for s in samples:
        rows += [s.routes[n:].long(), torch.full((1, *shape), -1, dtype=torch.int64)]
    return torch.cat(rows)


def build_batches(groups, config):
    """train_grpo.build_batches, each batch carrying the engine's experts for its rows
    when the engine recorded them (record_routes, routing_replay)."""
    docs = train_grpo.documents(groups, config)
    sizes = [d.num_tokens for d in docs]
    batches = []
    for part in training.split_under_budget(sizes, config["batch_tokens"]):
        batch = train_grpo.pack([docs[i] for i in part])
        if docs[0].samples[0].routes is not None:
            routes = [document_routes(docs[i].prompt, docs[i].samples) for i in part]
            batch = dataclasses.replace(batch, routes=torch.cat(routes))
        batches.append(batch)
    return batches


def policy_loss(logp, batch, normalizer, config, stats=None):
    """train_grpo.policy_loss, or with ppo_clip > 0 PPO's clipped objective on the same
    weights (ppo_loss; stats counts the rows it clipped)."""
    if config["ppo_clip"] > 0:
        old = logp.detach() if batch.old_log_probs is None else batch.old_log_probs
        loss, clipped = ppo_loss(logp, old, batch.token_weights, batch.loss_mask,
                                 config["ppo_clip"], normalizer)
        if stats is not None:
            stats["clipped"] += clipped
        return loss
    return train_grpo.policy_loss(logp, batch, normalizer, config)


# -----------------------------------------------------------------------------
# the corrections' pass


@torch.no_grad()
def trainer_logprobs(model, batch, autocast, temperature, routes_out=None):
    """log p(label) at temperature of every row under the trainer's current weights
    (before the step)."""
    with autocast:
        return training.batch_logprobs(model, batch, routes_out, temperature)[0]


def needs_trainer_pass(config):
    """Whether a step scores its batches with the trainer's weights before the update:
    for an IS correction, the KL term, PPO's old logprobs or the engine's experts to
    compare."""
    return (config["tis_cap"] > 0 or config["mis_high"] > 0 or config["kl_coef"] > 0
            or config["ppo_clip"] > 0 or config["record_routes"] or config["routing_replay"])


def apply_corrections(batches, model, reference, autocast, config):
    """The per-token no-grad factors folded into the weights (the loss contract), from a
    logprob pass of the trainer's current weights (the formulas above): an
    IS factor (tis_cap: truncated, mis_high: masked; is_level='sequence': of the
    sample's geometric mean ratio) multiplies the advantage; with kl_coef > 0, kl_coef *
    (trainer - reference logprob) is subtracted; with ppo_clip > 0 the pass's logprobs
    are PPO's old ones. With the engine's experts recorded, the pass routes by them
    (routing_replay) or by its own router, and counts where the two differ. Without any
    of these there is no pass: on-policy, the step's own forward measures the mismatch.
    Returns (batches, metrics)."""
    if not needs_trainer_pass(config):
        return batches, {}
    # tokens corrected of those sampled; expert pairs differing of those compared
    out = []
    counts = dict(corrected=0, sampled=0, differ=0, pairs=0)
    T = config["temperature"]   # both score the distribution the engine sampled
    for _ in range(distributed.missing(len(batches))):   # FSDP2: as many forwards as any rank
        trainer_logprobs(model, training.empty_batch(config["device"]), autocast, T)
    for b in batches:   # this rank's share of the step's micro-batches
        engine_routes = b.routes
        b = b if config["routing_replay"] else dataclasses.replace(b, routes=None)
        used = None if engine_routes is None else []
        lp = trainer_logprobs(model, b, autocast, T, used)
        mask, w = b.loss_mask, b.token_weights
        ids = sample_ids(b) if config["is_level"] == "sequence" else None
        factor, changed = is_factor(importance_ratios(lp, b.log_probs, mask, ids),
                                    config["tis_cap"], config["mis_low"], config["mis_high"])
        w = w * factor
        if config["kl_coef"] > 0:
            reference_lp = trainer_logprobs(reference, b, autocast, T)
            w = w - config["kl_coef"] * torch.where(mask, lp - reference_lp, 0.0)
        counts["corrected"] += int((changed & mask).sum())
        counts["sampled"] += int(mask.sum())
        if used is not None:
            differ, pairs = expert_disagreement(torch.stack(used, 1), engine_routes, mask)
            counts["differ"] += differ
            counts["pairs"] += pairs
        out.append(dataclasses.replace(b, token_weights=w, old_log_probs=lp))
    total = dict(zip(counts, distributed.all_sum(counts.values())))   # over the ranks
    metrics = {"offpolicy/corrected": total["corrected"] / max(total["sampled"], 1)}
    if total["pairs"]:
        metrics["offpolicy/expert_disagreement"] = total["differ"] / total["pairs"]
    return out, metrics


# -----------------------------------------------------------------------------
# where the groups come from, and one iteration


class Colocated:
    """Where a step's groups come from and its new weights go, in one process: its engine
    samples with the trainer's current weights, swapped in place after each step
    (train_grpo.grpo_step's steps 1 and 5). Rollout ranks and servers have the same
    interface (the docstring above)."""

    def __init__(self, engine, env, sampler, config):
        self.engine = engine
        self.env = env
        self.sampler = sampler
        self.config = config

    @property
    def version(self):
        return self.engine.get_weight_version()

    def groups(self, it):
        out = train_grpo.rollout(self.engine, self.env, self.sampler, self.config, it)
        if self.config["engine_sleep"]:   # the step needs neither its weights nor its KV pool
            self.engine.sleep()
        return out

    def publish(self, model, it):
        return train_grpo.publish(self.engine, model, self.config)

    def eval_engine(self, model):
        return self.engine

    def data_state(self):
        return self.sampler.state_dict()


def grpo_step(source, run, reference, config, it):
    """One iteration, train_grpo.grpo_step's with a source and the corrections. Returns
    its metrics and the FLOPs it spent."""
    clock = {"start": time.perf_counter()}
    # 1. the source's groups for iteration it (kept: those with reward variance)
    groups, flops, metrics = source.groups(it)
    clock["rollout"] = time.perf_counter()
    batches = []
    if not groups:   # every group had zero reward variance: no step, the weights stay
        print0(f"iter {it + 1}: no group with reward variance")
    else:
        # 2. advantages x loss mask as token weights, packed; the normalizer, fixed first
        batches = build_batches(groups, config)
        normalizer = train_grpo.loss_normalizer(batches, config)
        # 3. this rank's share, with the IS factor / the KL folded into its weights
        mine = [b.to(config["device"]) for b in distributed.shard(batches)]
        mine, corrected = apply_corrections(mine, run.forward, reference, run.autocast, config)
        metrics.update(corrected)
        clock["batches"] = time.perf_counter()
        # 4. ppo_epochs optimizer steps on policy_loss
        metrics.update(optimizer_steps(run, mine, normalizer, config, it))
        metrics["train/normalizer"] = normalizer
        clock["step"] = time.perf_counter()
    # 5. publish the new weights to whatever samples
    metrics.update(source.publish(run.model, it))
    clock["end"] = time.perf_counter()
    passes = needs_trainer_pass(config) + (reference is not None)
    flops += train_grpo.step_bookkeeping(metrics, clock, batches, run, passes,
                                         config["ppo_epochs"])
    if batches:
        metrics["perf/logprob_pass_s"] = clock["batches"] - clock["rollout"]
    if "perf/rollout_wait_s" in metrics:   # rollout ranks, servers: waiting on them
        waited = metrics["perf/rollout_wait_s"] + metrics.get("perf/weight_sync_wait_s", 0.0)
        metrics["perf/trainer_idle_frac"] = waited / metrics["perf/step_time_s"]
    return metrics, flops


def optimizer_steps(run, batches, normalizer, config, it):
    """ppo_epochs optimizer steps on the step's batches (one by default); the metrics of
    the last, with the first's logprob mismatch and KL (those of the weights that
    sampled) and the share of sampled tokens PPO's clip held back over all of them."""
    stats = {"clipped": 0}
    lr = training.scheduled_lr(config, it)
    loss_fn = functools.partial(policy_loss, config=config, stats=stats)
    epochs = [training.train_step(run.forward, run.optimizer, batches, lr, config["grad_clip"],
                                  config["aux_loss_coef"], run.autocast, normalizer, loss_fn,
                                  config["temperature"])
              for _ in range(config["ppo_epochs"])]
    metrics = dict(epochs[-1])
    for name in ("train/logprob_mismatch", "offpolicy/kl_k3"):
        if name in epochs[0]:
            metrics[name] = epochs[0][name]
    if config["ppo_clip"] > 0:
        clipped, sampled = distributed.all_sum(
            [stats["clipped"], sum(int(b.loss_mask.sum()) for b in batches)])
        metrics["offpolicy/ppo_clipped"] = clipped / max(sampled * config["ppo_epochs"], 1)
    return metrics


# -----------------------------------------------------------------------------
# setup and the loop


def check_settings(config):
    """train_grpo.py's settings, then this file's, each refused with a ValueError naming
    it before any work."""
    train_grpo.check_settings(config)
    at_least = dict(ppo_epochs=1, tis_cap=0, mis_low=0, mis_high=0, kl_coef=0, ppo_clip=0)
    for name, low in at_least.items():
        require(config[name] >= low, f"{name}={config[name]!r}: expected >= {low}")
    level = config["is_level"]
    require(level in ("token", "sequence"), f"is_level={level!r}: expected token or sequence")
    kl, scratch = config["kl_coef"], config["init_from"] == "scratch"
    require(not (kl and scratch), f"kl_coef={kl}: a KL to init_from='scratch' teaches nothing")
    check_off_policy_settings(config)
    check_source_settings(config)


def check_off_policy_settings(config):
    """The corrections' settings: one IS correction at a time, and what needs what."""
    tis, lo, hi = config["tis_cap"], config["mis_low"], config["mis_high"]
    clip, epochs, level = config["ppo_clip"], config["ppo_epochs"], config["is_level"]
    require(not (tis and hi), f"tis_cap={tis}, mis_high={hi}: truncated and masked IS, set one")
    require(hi == 0 or lo < 1 < hi, f"mis_low={lo}, mis_high={hi}: the range must hold 1")
    require(level == "token" or tis > 0 or hi > 0, f"is_level={level!r}: set tis_cap or mis_high")
    require(clip < 1, f"ppo_clip={clip}: expected in [0, 1)")
    # a later epoch trains off-policy on the same rollout
    require(epochs == 1 or clip > 0, f"ppo_epochs={epochs} needs ppo_clip > 0 (e.g. 0.2)")


def check_source_settings(config):
    """Where the rollouts come from: rollout ranks or servers, and what each allows."""
    ranks, stale, urls = config["rollout_ranks"], config["max_staleness"], config["rollout_urls"]
    for name in ("rollout_ranks", "max_staleness"):
        require(config[name] >= 0, f"{name}={config[name]!r}: expected an int >= 0")
    # only rollout ranks or servers sample ahead of the trainer, and IS corrects what
    # older weights sampled (tis_cap or mis_high)
    require(not stale or ranks or urls, f"max_staleness={stale}: set rollout_ranks or rollout_urls")
    corrected = config["tis_cap"] > 0 or config["mis_high"] > 0
    require(stale == 0 or corrected,
            f"max_staleness={stale} trains on samples of older weights: set tis_cap or mis_high")
    # serve.py rollouts run with one trainer process; routes travel only from this
    # process's engine for now
    single_process = (ranks, distributed.world()) == (0, 1)
    require(not urls or single_process, f"rollout_urls={urls!r}: not with rollout_ranks, torchrun")
    routes = config["record_routes"] or config["routing_replay"]
    remote = ranks or urls
    require(not (routes and remote), "record_routes/routing_replay: not with rollout_ranks/urls")
    backend = config["weight_backend"]
    require(backend in ("gloo", "nccl"), f"weight_backend={backend!r}: expected gloo or nccl")
    device = config["device"]   # nccl broadcasts from a GPU; gloo runs on any
    cuda = device.startswith("cuda")
    require(backend == "gloo" or cuda, f"weight_backend='nccl' needs a cuda device, not {device!r}")
    require(config["weight_master_address"], "weight_master_address='': expected a host")
    check_verifiers_cmd(config)
    mb = config["weight_bucket_mb"]
    require(mb > 0, f"weight_bucket_mb={mb!r}: expected a number > 0")
    elsewhere = ranks or urls
    require(not (config["engine_sleep"] and elsewhere),
            "engine_sleep=True with rollout_ranks / rollout_urls: the trainer's engine only "
            "evaluates there; engine_sleep is the colocated engine's")
    require(not (config["fsdp"] and elsewhere),
            "fsdp=True with rollout_ranks / rollout_urls: their weight sync sends whole "
            "tensors from one rank, not shards yet; use fsdp with the colocated engine")


def check_verifiers_cmd(config):
    """verifiers_cmd: a command line, with servers to play against, sampling as the
    environment's client does (no top_p, top_k)."""
    cmd = config["verifiers_cmd"]
    if not cmd:
        return
    try:
        words = shlex.split(cmd)
    except ValueError as e:   # an unclosed quote: the user's mistake, one line (run_cli)
        raise BadValue(f"verifiers_cmd={cmd!r}: {e}") from None
    require(words, f"verifiers_cmd={cmd!r}: expected a command")
    require(config["rollout_urls"], f"verifiers_cmd={cmd!r}: the environment plays against "
            "servers: set rollout_urls")
    require(config["top_p"] == 1.0 and config["top_k"] == 0,
            f"top_p={config['top_p']!r}, top_k={config['top_k']!r}: verifiers' client samples "
            "the whole distribution (1.0 and 0 with verifiers_cmd)")


def make_source(config, roles, model, problems, engine, start_iter):
    """The trainer ranks' source: servers (rollout_urls), rollout ranks, or this
    process's engine (Colocated). engine evaluates, or samples too when colocated."""
    version = engine.get_weight_version()
    if config["rollout_urls"]:
        # a verifiers environment's episodes, or the task's
        rollout = verifiers_groups.rollout if config["verifiers_cmd"] else train_grpo.rollout
        return Servers(config, problems.env, problems.sampler, model, engine, version, rollout,
                       start_iter)
    if roles is not None:
        return RolloutRanks(config, roles, model, problems.sampler, engine, version)
    return Colocated(engine, problems.env, problems.sampler, config)


def rollout_rank_job(config, roles, start, problems):
    """A rollout rank's whole job: an engine of the run's starting weights, fed by the
    weight broadcast, sampling every iteration's rollout (rollout_ranks.run_worker)."""
    if start.meta is not None:
        problems.sampler.load_state_dict(start.meta["data_state"])
    engine = problems.engine(start.model.to(config["device"]), engine_config(config, start))
    run_worker(config, roles, start, problems.env, problems.sampler, engine, train_grpo.rollout)
    engine.shutdown()
    distributed.teardown()
    return {}


def reference_model(config, start):
    """The starting policy, frozen, for the KL term (None when kl_coef = 0). A resumed run
    reloads the model its first run started from."""
    if config["kl_coef"] == 0:
        return None
    source = config["init_from"] if start.meta is None else start.meta["config"]["init_from"]
    return load_model(model_dir_of(source)).to(config["device"]).eval().requires_grad_(False)


def engine_config(config, start):
    """train_grpo.engine_config, recording each token's experts for routing replay."""
    routes = config["record_routes"] or config["routing_replay"]
    return dataclasses.replace(train_grpo.engine_config(config, start), record_routes=routes)


def main(config):
    config["device"] = distributed.setup(config["device"], config["dist_timeout_s"])
    check_settings(config)
    # with rollout ranks: which ranks sample, which train
    roles = distributed.split_roles(config["rollout_ranks"]) if config["rollout_ranks"] else None
    the_task = load_task(config["task"])
    start = init_start(config, build_tokenizer)
    problems = train_grpo.load_problems(the_task, start, config)
    if roles is not None and roles.is_worker:   # a rollout rank only samples
        return rollout_rank_job(config, roles, start, problems)
    reference = reference_model(config, start)
    run = training.setup_run(config, start, problems.sampler)
    engine = problems.engine(run.model, engine_config(config, start))
    if engine.static is not None:
        print0(f"engine: decode step compiled in {engine.static.warm_up():.1f} s (once a process)")
    source = make_source(config, roles, run.model, problems, engine, start.iter_num)
    meter = training.Meter(run.start)
    best = train_grpo.best_so_far(config, start)
    print0(f"{config['prompts_per_step']} prompts x {config['group_size']} samples per step, "
           f"{len(problems.eval)} {config['eval_split']} problems")
    final = {} if start.meta is not None else \
        train_grpo.evaluate_and_log(engine, problems, run, config, 0, meter, best)
    for it in range(start.iter_num, config["max_iters"]):
        metrics, flops = grpo_step(source, run, reference, config, it)
        metrics.update(meter.add(flops, metrics["perf/step_time_s"]))
        done = it + 1
        last = done == config["max_iters"]
        if training.due(config, "log_interval", done, last):
            train_grpo.log_iteration(run.logger, done, metrics)
        if training.due(config, "eval_interval", done, last):
            final = train_grpo.evaluate_and_log(source.eval_engine(run.model), problems, run,
                                                config, done, meter, best)
        if training.due(config, "ckpt_interval", done, last):
            training.save(run, config, done, source.data_state(),
                          RunState(meter=meter.state_dict(), weight_version=source.version,
                                   best=best))
    run.logger.close()
    engine.shutdown()
    del run, source, engine   # a sharded model and its optimizer go before the process group
    distributed.teardown()
    return final


if __name__ == "__main__":
    run_cli(main, globals(), "grpo")
