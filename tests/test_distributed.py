"""
torchrun: pretrain, SFT and GRPO on 2 gloo ranks (CPU) against the same run in one
process, resume across world sizes, and a killed rank. Every run is a real `python -m
torch.distributed.run` (torchrun) of the real script.

    python -m pytest -q tests/test_distributed.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import checkpoint
from conftest import FINISHED, run_ranks, write_task
from test_grpo import CORRECTED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "config", "qwen_small.py")

# Runs a script the way torchrun would, with two test-only additions: on a rank other than
# 0, any write under OUT_DIR but its optimizer shards fails the run (only rank 0 writes),
# and GRPO dumps its sampled groups to SAMPLES_OUT.<rank>.json. (launch gives GRPO the parity task,
# conftest.PARITY_TASK, unless the test names another: a random policy gets reward
# variance from it.)
LAUNCHER = r'''
import json, os, runpy, sys
sys.path.insert(0, os.environ["ROOT"])
out_dir, rank = os.path.realpath(os.environ["OUT_DIR"]), int(os.environ.get("RANK", "0"))

def guard(event, args):
    path = None
    if event == "open" and args[0] is not None and not isinstance(args[0], int):
        mode, flags = args[1] or "", args[2] or 0
        if any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            path = args[0]
    elif event in ("os.rename", "os.replace", "os.mkdir", "os.remove", "os.rmdir", "shutil.rmtree"):
        path = args[0]
    real = path is not None and os.path.realpath(os.fsdecode(path))
    # (but each rank's optimizer shards of a sharded run: checkpoint.save_checkpoint)
    shards = os.path.join(out_dir, "ckpt.tmp", "optimizer")
    if path is not None and (real == out_dir or real.startswith(out_dir + os.sep)) \
            and not (real == shards or real.startswith(shards + os.sep)):
        raise PermissionError(f"rank {rank} wrote {path}: only rank 0 may write")

if rank != 0:
    sys.addaudithook(guard)
script, argv = sys.argv[1], sys.argv[2:]
if os.path.basename(script) in ("train_grpo.py", "train_grpo_async.py"):
    import importlib
    import train_grpo   # whose rollout both scripts call (the async one from any rank)
    from configurator import configure
    seen, real = [], train_grpo.rollout
    def rollout(*a):
        groups, flops, metrics = real(*a)
        seen.append([[list(s.completion_tokens), list(s.logprobs)]
                     for g in groups for s in g.samples])
        return groups, flops, metrics
    train_grpo.rollout = rollout
    module = importlib.import_module(os.path.basename(script)[:-3])
    settings = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    module.main(configure(settings, argv, stage="grpo"))
    with open(os.environ["SAMPLES_OUT"] + f".{rank}.json", "w") as f:
        json.dump(seen, f)
else:
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")
''' + FINISHED

TINY = (
    "{'hidden_size':32,'intermediate_size':64,'moe_intermediate_size':32,'num_hidden_layers':2,"
    "'num_attention_heads':2,'num_key_value_heads':1,'head_dim':16,'num_experts':4,"
    "'num_experts_per_tok':2,"
    "'max_position_embeddings':128}"
)
PRETRAIN = ["--n_docs=200", "--n_val_docs=16", "--batch_tokens=256", "--grad_accum=2",
            f"--model={TINY}", "--log_interval=1", "--eval_interval=5", "--lr_decay_iters=5",
            "--warmup_iters=1"]


def launch(tmp, script, out_dir, args, nproc=1, wait=True, timeout=300):
    """Run script (under torchrun when nproc > 1) with out_dir and args; returns the
    CompletedProcess (or Popen)."""
    launcher = tmp / "launcher.py"
    launcher.write_text(LAUNCHER)
    env = dict(os.environ, ROOT=ROOT, OUT_DIR=str(out_dir), SAMPLES_OUT=str(out_dir) + ".samples",
               OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=ROOT)
    grpo = script in ("train_grpo.py", "train_grpo_async.py")
    if grpo and not any(str(a).startswith("--task=") for a in args):
        args = [f"--task={write_task(str(tmp))}", *args]
    argv = [launcher, os.path.join(ROOT, script), CONFIG, f"--out_dir={out_dir}", *args]
    if not wait:
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}"] \
            if nproc > 1 else [sys.executable]
        return subprocess.Popen(run + [str(a) for a in argv], env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = run_ranks(argv, nproc, env, cwd=tmp, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def assert_same_run(a, b, keys, rel=1e-5, only=lambda row: True):
    ra, rb = [r for r in rows(a) if only(r)], [r for r in rows(b) if only(r)]
    assert [r["iter"] for r in ra] == [r["iter"] for r in rb]
    checked = 0
    for x, y in zip(ra, rb):
        for k in keys:
            if k in x:
                assert abs(x[k] - y[k]) <= rel * max(abs(x[k]), 1e-3), (x["iter"], k, x[k], y[k])
                checked += 1
    assert checked >= 5


def weights(out_dir):
    return checkpoint.load_hf_checkpoint(os.path.join(out_dir, "ckpt")).state_dict()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """5 pretraining steps in one process, and the same on 2 ranks."""
    tmp = tmp_path_factory.mktemp("pretrain")
    one, two = tmp / "one", tmp / "two"
    launch(tmp, "pretrain.py", one, PRETRAIN + ["--max_iters=5"])
    launch(tmp, "pretrain.py", two, PRETRAIN + ["--max_iters=5"], nproc=2)
    return tmp, one, two


def test_pretrain_on_two_ranks_steps_like_one_process(pretrained):
    _, one, two = pretrained
    assert_same_run(one, two,
                    ("train/loss", "train/aux_loss", "train/grad_norm", "train/tokens",
                     "eval/loss"))
    a, b = weights(one), weights(two)
    assert all(torch.allclose(a[n], b[n], rtol=1e-4, atol=1e-6) for n in a)
    # rank 1 wrote nothing (the launcher fails any write of it under out_dir); rank 0
    # wrote it all
    assert sorted(os.listdir(two)) == sorted(os.listdir(one))


def test_grad_accum_must_split_over_the_ranks(pretrained):
    tmp = pretrained[0]
    with pytest.raises(AssertionError, match="grad_accum=1: expected a multiple of the 2 ranks"):
        launch(tmp, "pretrain.py", tmp / "bad", PRETRAIN + ["--max_iters=1", "--grad_accum=1"],
               nproc=2)


def test_a_two_rank_checkpoint_resumes_on_one_rank_exactly(pretrained):
    tmp, one, _ = pretrained
    half = tmp / "half"
    launch(tmp, "pretrain.py", half, PRETRAIN + ["--max_iters=3", "--ckpt_interval=3"], nproc=2)
    launch(tmp, "pretrain.py", half, PRETRAIN + ["--max_iters=5", "--init_from=resume"])
    # (the 2-rank run also evaluated at its last step, 3)
    assert_same_run(one, half, ("train/loss", "train/grad_norm"),
                    only=lambda row: "train/loss" in row)
    assert (
        abs(rows(one)[-1]["eval/loss"] - rows(half)[-1]["eval/loss"])
        < 1e-5 * rows(one)[-1]["eval/loss"]
    )


SFT = ["--max_iters=5", "--grad_accum=2", "--batch_tokens=256", "--n_eval_problems=12",
       "--eval_interval=5", "--log_interval=1", "--demo_fraction=0.02", "--keep_best=True"]


@pytest.fixture(scope="module")
def sft_one(pretrained):
    """SFT in one process from the pretrained model: what DDP and FSDP2 must equal."""
    tmp, one, _ = pretrained
    launch(tmp, "sft.py", tmp / "sft_one", [f"--init_from={one}", *SFT])
    return tmp / "sft_one"


def test_sft_on_two_ranks_steps_like_one_process(pretrained, sft_one):
    tmp, one, _ = pretrained
    launch(tmp, "sft.py", tmp / "sft2", [f"--init_from={one}", *SFT], nproc=2)
    assert_same_run(sft_one, tmp / "sft2",
                    ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy"))


def test_grpo_on_two_ranks_samples_and_steps_like_one_process(tmp_path):
    # train_grpo_async.py with the corrections (routing replay, masked IS, PPO's two
    # epochs), which add a logprob pass the ranks pad as they pad the step (train_grpo.py's
    # plain path: the multi-turn test below, and FSDP2's LoRA run)
    corrections = CORRECTED
    args = ["--init_from=scratch", f"--model={TINY}", "--max_iters=5", "--prompts_per_step=5",
            "--group_size=4", "--max_new_tokens=8", "--n_eval_problems=6", "--pass_k=2",
            "--learning_rate=3e-3", "--warmup_iters=0", "--eval_interval=5", "--log_interval=1",
            "--batch_tokens=128", *corrections]
    one, two = tmp_path / "one", tmp_path / "two"
    launch(tmp_path, "train_grpo_async.py", one, args)
    launch(tmp_path, "train_grpo_async.py", two, args, nproc=2)
    assert_same_run(one, two,
                    ("train/loss", "train/grad_norm", "rollout/reward_mean", "rollout/problems",
                     "train/tokens", "eval/accuracy", "eval/pass@1"))
    # fp32 rounding only
    assert all(r["train/logprob_mismatch"] < 1e-5 for r in rows(two) if "train/loss" in r)
    single = json.loads((tmp_path / "one.samples.0.json").read_text())
    for r in (0, 1):   # every rank saw every group, and they are the single process's samples
        ranked = json.loads((tmp_path / f"two.samples.{r}.json").read_text())
        assert [[s[0] for s in step] for step in ranked] == [[s[0] for s in step]
                                                             for step in single]
        assert max(abs(x - y) for a, b in zip(ranked, single) for s, t in zip(a, b)
                   for x, y in zip(s[1], t[1])) < 1e-5
    assert sum(len(step) for step in single) >= 5 * 4


def test_multi_turn_grpo_on_two_ranks_steps_like_one_process(tmp_path):
    # test_environment's multi-turn task: each rank runs its share of every turn's episodes
    from test_environment import AGAIN_TASK
    again = write_task(str(tmp_path), AGAIN_TASK, "again.py")
    model = TINY.replace("'max_position_embeddings':128", "'max_position_embeddings':512")
    args = ["--init_from=scratch", f"--model={model}", f"--task={again}", "--max_iters=4",
            "--prompts_per_step=8", "--group_size=4", "--max_new_tokens=40", "--max_turns=3",
            "--max_episode_tokens=160", "--n_eval_problems=6", "--pass_k=0", "--learning_rate=3e-3",
            "--warmup_iters=0", "--eval_interval=4", "--log_interval=1", "--batch_tokens=1024"]
    one, two = tmp_path / "one", tmp_path / "two"
    launch(tmp_path, "train_grpo.py", one, args)
    launch(tmp_path, "train_grpo.py", two, args, nproc=2)
    assert_same_run(one, two, ("train/loss", "rollout/reward_mean", "rollout/turns_mean",
                               "train/tokens", "eval/accuracy", "eval/success_by_turn_3"))
    assert max(r["rollout/turns_mean"] for r in rows(two) if "rollout/turns_mean" in r) > 1


def test_a_killed_rank_ends_the_job_and_resume_works(pretrained):
    tmp, _, _ = pretrained
    out = tmp / "killed"
    job = launch(tmp, "pretrain.py", out,
                 PRETRAIN + ["--max_iters=100000", "--lr_decay_iters=100000", "--ckpt_interval=2",
                             "--dist_timeout_s=30"], nproc=2, wait=False)
    try:
        deadline = time.time() + 120
        while not (out / "ckpt").exists() or len(rows(out)) < 3:
            assert job.poll() is None and time.time() < deadline, "the 2-rank run did not get going"
            time.sleep(0.5)
        os.kill(rank_pid(job.pid, 1), signal.SIGKILL)
        t0 = time.time()
        job.wait(timeout=90)
        assert job.returncode != 0 and time.time() - t0 < 60
    finally:
        if job.poll() is None:
            job.kill()
    step = checkpoint.read_checkpoint_meta(checkpoint.find_checkpoint(str(out)))["iter"]
    launch(tmp, "pretrain.py", out, PRETRAIN + ["--init_from=resume", f"--max_iters={step + 2}",
                                                "--lr_decay_iters=100000"])
    assert [r["iter"] for r in rows(out) if "train/loss" in r][-2:] == [step + 1, step + 2]


def rank_pid(torchrun_pid, rank):
    """The pid of torchrun's worker with this RANK (found through /proc)."""
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if parent == torchrun_pid and f"RANK={rank}".encode() in env:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under pid {torchrun_pid}")


def test_ranks_whose_parameters_differ_are_caught(tmp_path):
    script = tmp_path / "drift.py"
    script.write_text(
        "import torch\n"
        "from scaleout import distributed\n"
        "distributed.setup('cpu', 60)\n"
        "torch.manual_seed(0)\n"
        "model = torch.nn.Linear(4, 4)\n"
        "distributed.check_in_sync(model)\n"            # the same weights on both ranks: passes
        "with torch.no_grad():\n"
        "    model.bias[0] += 1e-7 * distributed.rank()\n"  # one float's last bits on rank 1
        "try:\n"
        "    distributed.check_in_sync(model)\n"
        "except RuntimeError as e:\n"
        "    print(f'caught: {e}', flush=True)\n"   # one write per rank: the two do not interleave
        "distributed.teardown()\n" + FINISHED)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    done = run_ranks([script], 2, env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("caught: the ranks' parameters differ") == 2


def test_a_bad_collective_timeout_is_refused():
    from scaleout import distributed
    for bad in (0, -5, "300", None):
        with pytest.raises(ValueError, match="dist_timeout_s"):
            distributed.setup("cpu", bad)


@pytest.mark.parametrize("finish_first", [True, False])
def test_only_an_abort_after_every_rank_finished_is_forgiven(tmp_path, finish_first):
    # the harness's allowance for gloo's exit race (conftest.run_ranks) must not hide a
    # rank that died mid-job
    script = tmp_path / "aborts.py"
    body = ["import os, sys", "sys.stderr.write('terminate called without an active exception\\n')",
            "sys.stderr.flush()", "os.abort() if os.environ['RANK'] == '1' else None"]
    script.write_text("\n".join([FINISHED.strip()] + body if finish_first
                                else body + [FINISHED.strip()]) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = run_ranks([script], 2, env, timeout=120)
    assert (done.returncode == 0) == finish_first, done.stderr[-2000:]


# -----------------------------------------------------------------------------
# FSDP2 (fsdp=True): parameters, gradients and AdamW state sharded per block


def max_rel_diff(a, b):
    """The largest |a - b| over each tensor's largest |a|, over every tensor."""
    return max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp(min=1e-12)).item()
               for n in a)


def test_fsdp_pretrain_on_two_ranks_steps_like_one_process(pretrained):
    tmp, one, _ = pretrained
    launch(tmp, "pretrain.py", tmp / "fsdp", PRETRAIN + ["--max_iters=5", "--fsdp=True"], nproc=2)
    assert_same_run(one, tmp / "fsdp", ("train/loss", "train/aux_loss", "train/grad_norm",
                                        "train/tokens", "eval/loss"), rel=1e-6)
    assert max_rel_diff(weights(one), weights(tmp / "fsdp")) < 1e-6
    # each rank's optimizer shards, through torch.distributed.checkpoint
    shards = sorted(os.listdir(tmp / "fsdp" / "ckpt" / "optimizer"))
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2


def test_fsdp_checkpoints_resume_on_another_world_size(pretrained):
    # 3 steps on 2 FSDP2 ranks, resumed on 1 rank for a 4th, resumed on 2 ranks for the
    # 5th: the uninterrupted one-process run's numbers and weights
    tmp, one, _ = pretrained
    out = tmp / "two_one_two"
    for ranks, until in ((2, 3), (1, 4), (2, 5)):
        resume = ["--init_from=resume"] if until > 3 else []
        fsdp = ["--fsdp=True"] if ranks == 2 else []
        launch(tmp, "pretrain.py", out, PRETRAIN + [f"--max_iters={until}", *resume, *fsdp],
               nproc=ranks)
        assert checkpoint.read_checkpoint_meta(str(out / "ckpt"))["iter"] == until
    assert_same_run(one, out, ("train/loss", "train/grad_norm"), rel=1e-6,
                    only=lambda row: "train/loss" in row)
    assert max_rel_diff(weights(one), weights(out)) < 1e-6


def test_fsdp_sft_on_two_ranks_steps_like_one_process(pretrained, sft_one):
    tmp, one, _ = pretrained
    launch(tmp, "sft.py", tmp / "sft_fsdp", [f"--init_from={one}", *SFT, "--fsdp=True"], nproc=2)
    assert_same_run(sft_one, tmp / "sft_fsdp",
                    ("train/loss", "train/grad_norm", "eval/loss", "eval/accuracy"), rel=1e-6)
    best = [checkpoint.load_hf_checkpoint(str(d / "best")).state_dict()
            for d in (sft_one, tmp / "sft_fsdp")]
    assert max_rel_diff(*best) < 1e-6


GRPO = ["--max_iters=4", "--lr_decay_iters=4", "--prompts_per_step=5", "--group_size=4",
        "--max_new_tokens=8",
        "--n_eval_problems=6", "--pass_k=2", "--warmup_iters=0", "--eval_interval=4",
        "--log_interval=1", "--batch_tokens=128", "--ckpt_interval=2", "--keep_best=True"]
LORA = ["--lora_rank=2", "--lora_alpha=4", "--learning_rate=3e-2"]


@pytest.mark.parametrize("lora", [False, True], ids=["full_corrected", "lora"])
def test_fsdp_grpo_on_two_ranks_steps_like_one_process(pretrained, lora):
    # the engines sample with the gathered weights; a step with one group leaves a rank
    # without a micro-batch (it joins the collectives with an empty one, in the step and
    # in the corrections' logprob pass: train_grpo_async.py's); LoRA + FSDP2 (train_grpo.py)
    tmp, one, _ = pretrained
    args = [f"--init_from={one}", "--learning_rate=3e-3", *GRPO, *(LORA if lora else CORRECTED)]
    script = "train_grpo.py" if lora else "train_grpo_async.py"
    a, b = tmp / f"grpo_{lora}_one", tmp / f"grpo_{lora}_fsdp"
    launch(tmp, script, a, args)
    launch(tmp, script, b, args + ["--fsdp=True"], nproc=2)
    assert_same_run(a, b, ("train/loss", "train/grad_norm", "rollout/reward_mean",
                           "train/tokens", "eval/accuracy", "eval/pass@1"), rel=1e-6)
    assert all(r["train/logprob_mismatch"] < 1e-5 for r in rows(b) if "train/loss" in r)
    assert any(r["rollout/valid_groups"] == 1 for r in rows(b) if "train/loss" in r)
    assert max_rel_diff(weights(a), weights(b)) < 1e-6
    if lora:   # the adapter gathered from the shards is the one process's
        from safetensors.torch import load_file
        adapters = [load_file(os.path.join(d, "ckpt", "adapter", "adapter_model.safetensors"))
                    for d in (a, b)]
        assert max_rel_diff(*adapters) < 1e-6


def test_fsdp_outside_torchrun_is_refused(pretrained):
    tmp = pretrained[0]
    with pytest.raises(AssertionError, match="fsdp=True outside torchrun"):
        launch(tmp, "pretrain.py", tmp / "alone", PRETRAIN + ["--max_iters=1", "--fsdp=True"])
    assert not os.path.exists(tmp / "alone")
