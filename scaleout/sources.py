"""
Where GRPO's groups come from when not from train_grpo's own engine: rollout ranks (the
last K ranks of a torchrun job sample, scaleout/rollout_ranks.py) or running servers
(rollout_urls, scaleout/rollout_servers.py). The seam with train_grpo.py is this file:
its settings join train_grpo's (SETTINGS), check_settings refuses bad ones before any
work, and make_source returns the trainer's source, or None for train_grpo.Colocated (the
trainer's own engine), which has the same interface:

    groups(it) -> (groups, flops, metrics)   iteration it's kept groups
                                             ([tasks.environment.Group]), what sampling
                                             them cost, the rollout metrics
    publish(model, it) -> metrics            hand model's new weights to whatever samples
    eval_engine(model) -> engine             an engine holding model's weights
    data_state() -> dict                     the sampler's record, for a checkpoint
    version                                  the trainer's weight version (checkpointed)

    torchrun --standalone --nproc_per_node=2 train_grpo.py config/qwen_small.py \\
        --rollout_ranks=1 --max_staleness=1 --tis_cap=2
    python train_grpo.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8000
    python train_grpo.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8000 \\
        --verifiers_cmd="/tmp/vf_venv/bin/python scaleout/verifiers_countdown.py"
"""

import shlex

from checks import BadValue, require
from scaleout import distributed, rollout_ranks, verifiers_groups
from scaleout.rollout_servers import Servers

SETTINGS = dict(
    rollout_ranks=0,                     # the last K ranks only sample, the others train; 0 = off
    max_staleness=0,                     # rollout j samples with the weights of step j - s
    weight_bucket_mb=64.0,               # bucket size of the weight broadcast
    rollout_urls="",                     # 'http://host:port[,...]': servers sample
    rollout_api_key="",                  # the servers' --api_key
    weight_master_address="127.0.0.1",   # where the servers reach the trainer's weight group
    weight_backend="gloo",               # the weight group's backend: 'gloo', or 'nccl' on cuda
    verifiers_cmd="",                    # a verifiers environment's episodes sample instead of
                                         # the task's: scaleout/verifiers_groups.py
)


def check_settings(config):
    """The scale-out settings, each refused with a ValueError naming it."""
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


def split_roles(config):
    """With rollout ranks, which ranks sample and which train
    (distributed.split_roles); None without."""
    return distributed.split_roles(config["rollout_ranks"]) if config["rollout_ranks"] else None


def make_source(config, roles, model, env, sampler, engine, rollout, start_iter):
    """The rollout source of the trainer ranks: servers (rollout_urls), rollout ranks, or
    None (train_grpo.Colocated: the trainer's own engine samples). rollout is
    train_grpo.rollout; engine evaluates."""
    version = engine.get_weight_version()
    if config["rollout_urls"]:
        if config["verifiers_cmd"]:   # the episodes of a verifiers environment
            rollout = verifiers_groups.rollout
        return Servers(config, env, sampler, model, engine, version, rollout, start_iter)
    if roles is not None:
        return rollout_ranks.RolloutRanks(config, roles, model, sampler, engine, version)
    return None


def run_worker(config, roles, start, env, sampler, make_engine, rollout):
    """A rollout rank's whole job: an engine of the run's starting weights, fed by the
    weight broadcast, sampling every iteration's rollout (rollout_ranks.run_worker)."""
    if start.meta is not None:
        sampler.load_state_dict(start.meta["data_state"])
    engine = make_engine(start.model.to(config["device"]))
    rollout_ranks.run_worker(config, roles, start, env, sampler, engine, rollout)
    engine.shutdown()
    distributed.teardown()
    return {}
