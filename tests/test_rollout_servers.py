"""
train_grpo_async --rollout_urls: rollouts sampled by real scaleout/serve.py processes over
HTTP, the trainer's weights pushed to them over a gloo group of their own, against
the colocated run.

    python -m pytest -q tests/test_rollout_servers.py
"""

import httpx
import pytest

import train_grpo
import train_grpo_async
from test_grpo import TINY, metrics, tiny_config
from test_serve import Served

MODEL = f"--model={dict(TINY, max_position_embeddings=256)!r}".replace(" ", "")
SAME = ("train/loss", "train/grad_norm", "train/tokens", "rollout/reward_mean",
        "rollout/problems_total", "rollout/completion_len", "eval/accuracy", "eval/pass@1")


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models on one thread


def assert_same(a, b, rel=1e-5, at_least=20):
    ra, rb = metrics(a), metrics(b)
    assert [r["iter"] for r in ra] == [r["iter"] for r in rb]
    checked = 0
    for x, y in zip(ra, rb):
        for k in SAME:
            if k in x:
                assert abs(x[k] - y[k]) <= rel * max(abs(x[k]), 1e-3), (x["iter"], k, x[k], y[k])
                checked += 1
    assert checked >= at_least


def run_async(out_dir, *args):
    """train_grpo_async.py (rollout_urls is its setting) on tiny_config(out_dir, *args)."""
    return train_grpo_async.main(tiny_config(out_dir, *args, script=train_grpo_async))


def stats(server):
    return httpx.get(server.url + "/stats").json()


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    """5 colocated iterations; its checkpoint is what the servers load (the trainer then
    pushes its own starting weights to them)."""
    tmp = tmp_path_factory.mktemp("servers")
    args = [MODEL, "--max_iters=5", "--ckpt_interval=5", "--eval_interval=5"]
    train_grpo.main(tiny_config(tmp / "one", *args))
    return tmp, args


def test_one_and_two_servers_sample_what_the_colocated_run_samples(colocated):
    tmp, args = colocated
    servers = [Served(tmp / "one" / "ckpt", "--enable_weight_updates=True") for _ in range(2)]
    try:
        one = f"--rollout_urls={servers[0].url}"
        run_async(tmp / "served", *args, one)
        assert_same(tmp / "one", tmp / "served")
        rows = [r for r in metrics(tmp / "served") if "train/loss" in r]
        # rollout j waited for the weights after iteration j - 1: pushed before
        # it, never inside
        assert [r["perf/weight_sync_s"] > 0 for r in rows] == [False, True, True, True, True]
        assert all(r["rollout/staleness_max"] == 0 for r in rows)
        generated = [stats(s)["generated_tokens"] for s in servers]
        assert generated[0] > 0 and generated[1] == 0
        both = f"--rollout_urls={servers[0].url},{servers[1].url}"   # each samples half
        run_async(tmp / "two", *args, both)
        assert_same(tmp / "one", tmp / "two")
        more = [stats(s)["generated_tokens"] - g for s, g in zip(servers, generated)]
        assert more[0] > 0 and more[1] > 0 and 0.5 < more[0] / more[1] < 2, more
    finally:
        for s in servers:
            s.stop()


def test_a_killed_server_fails_the_step_naming_it_and_resume_continues(colocated, monkeypatch):
    tmp, args = colocated
    server = Served(tmp / "one" / "ckpt", "--enable_weight_updates=True")
    out = tmp / "killed"
    real = train_grpo.rollout

    def dies_at_3(engine, env, sampler, config, it):
        if it == 3:
            server.proc.kill()
            server.proc.wait()
        return real(engine, env, sampler, config, it)
    monkeypatch.setattr(train_grpo, "rollout", dies_at_3)
    url = server.url
    with pytest.raises(RuntimeError, match=f"rollout server {url}"):
        run_async(out, *args[:-2], "--ckpt_interval=2", "--eval_interval=5",
                  f"--rollout_urls={url}")
    monkeypatch.setattr(train_grpo, "rollout", real)
    back = Served(tmp / "one" / "ckpt", "--enable_weight_updates=True")
    try:
        run_async(out, *args[:-2], "--ckpt_interval=2", "--eval_interval=5",
                  "--init_from=resume", f"--rollout_urls={back.url}")
    finally:
        back.stop()
    # iterations 3..5 again from the checkpoint at 2: what the uninterrupted run trained on
    full = {r["iter"]: r for r in metrics(tmp / "one") if "train/loss" in r}
    resumed = {r["iter"]: r for r in metrics(out) if "train/loss" in r}
    for it in (3, 4, 5):
        assert resumed[it]["train/loss"] == pytest.approx(full[it]["train/loss"], rel=1e-5)


def test_multi_turn_episodes_through_a_server_step_like_the_colocated_run(tmp_path):
    # test_environment's multi-turn task: every turn of every episode goes
    # through the server
    from conftest import write_task
    from test_environment import AGAIN_TASK
    again = write_task(str(tmp_path), AGAIN_TASK, "again.py")
    args = [MODEL, f"--task={again}", "--max_iters=3", "--ckpt_interval=3", "--eval_interval=3",
            "--prompts_per_step=8", "--max_turns=3", "--max_new_tokens=40",
            "--max_episode_tokens=160", "--pass_k=0"]
    train_grpo.main(tiny_config(tmp_path / "one", *args))
    server = Served(tmp_path / "one" / "ckpt", "--enable_weight_updates=True")
    try:
        run_async(tmp_path / "served", *args, f"--rollout_urls={server.url}")
    finally:
        server.stop()
    assert_same(tmp_path / "one", tmp_path / "served", at_least=8)
    assert max(r["rollout/turns_mean"] for r in metrics(tmp_path / "served")
               if "rollout/turns_mean" in r) > 1


def test_staleness_one_samples_the_next_rollout_while_training(colocated):
    tmp, args = colocated
    server = Served(tmp / "one" / "ckpt", "--enable_weight_updates=True")
    try:
        run_async(tmp / "stale", *args, "--max_staleness=1", "--tis_cap=2",
                  f"--rollout_urls={server.url}")
    finally:
        server.stop()
    rows = [r for r in metrics(tmp / "stale") if "rollout/staleness_max" in r]
    # rollouts 0 and 1 with the starting weights, rollout j >= 1 with those after
    # iteration j - 1
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1, 1]
    assert all(r["train/logprob_mismatch"] > 1e-4 for r in rows[1:] if "train/loss" in r)


def test_vllm_servers_get_unseeded_rollouts(monkeypatch):
    # vLLM draws every prompt of a request from the one seed (and its CPU engine dies on a
    # seeded partial prefill), so a server that is not ours gets the rollout unseeded;
    # ours gets the seed, which makes its samples the colocated run's
    from engine import SamplingParams
    from scaleout.rollout_servers import RemoteEngine
    sent = []

    class Answer:
        def __init__(self, body):
            self.status_code, self.body = 200, body

        def json(self):
            return self.body

    def post(url, json, headers, timeout):
        sent.append(json)
        return Answer({"choices": [{
            "prompt_token_ids": [1, 2], "token_ids": [3], "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5]}}]})
    monkeypatch.setattr(httpx, "post", post)
    params = SamplingParams(temperature=1.0, max_tokens=1, seed=7)
    for owner, seed in (("vllm", None), ("nano-rl", 7)):
        monkeypatch.setattr(httpx, "get", lambda url, headers, timeout, owner=owner: Answer(
            {"data": [{"id": "m", "owned_by": owner}]}))
        remote = RemoteEngine(["http://h:1"], None)
        assert len(remote.generate([[1, 2]], params)) == 1
        assert sent[-1]["seed"] == seed


def test_the_trainer_waits_for_a_server_that_is_not_up_and_names_it():
    from scaleout.rollout_servers import wait_until_up
    from test_serve import free_port
    url = f"http://127.0.0.1:{free_port()}"   # nothing listens there
    with pytest.raises(RuntimeError, match=f"rollout server {url}: no answer to GET /health "
                       "within 1 s"):
        wait_until_up([url], timeout_s=1)


def test_a_lora_trainer_pushes_its_merged_weights(colocated):
    # the servers hold whole weights: a LoRA trainer pushes its base + its update, merged
    # after each step (its state_dict, adapters apart, is no model a server holds), so the
    # server's logprobs stay the trainer's
    tmp, args = colocated
    server = Served(tmp / "one" / "ckpt", "--enable_weight_updates=True")
    try:
        run_async(tmp / "lora", *args, "--lora_rank=4", "--learning_rate=3e-2",
                  f"--init_from={tmp / 'one' / 'ckpt'}",
                  f"--rollout_urls={server.url}")
    finally:
        server.stop()
    rows = [r for r in metrics(tmp / "lora") if "train/loss" in r]
    assert len(rows) >= 3 and all(r["train/logprob_mismatch"] < 1e-4 for r in rows), rows
