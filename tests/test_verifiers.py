"""
verifiers 0.4.0 collecting countdown episodes through scaleout/serve.py
(scaleout/verifiers_countdown.py): its training client, a harness (verifiers' own `null`
chat program, or the example's in-process ChatHarness with episodes run at once) and the
example's ChatML renderer, which bridges a next turn by token ids. What verifiers
records per episode (Trace.branches: token ids, sampled mask, logprobs) must be, token
for token, what the server sampled, for single-turn and 2-turn episodes.

verifiers lives in its own venv (scaleout/install_verifiers.sh, default /tmp/vf_venv;
VF_PYTHON names another interpreter), so the example runs there in a subprocess against
a scaleout/serve.py on a random tiny checkpoint. Skipped when that interpreter is
missing or cannot import verifiers 0.4.0. The null harness's chat program is a uv
script: its first run fetches openai, mcp, ... from PyPI into verifiers' cache.
"""

import json
import os
import subprocess

import pytest

from test_serve import Served, model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VF_PYTHON = os.environ.get("VF_PYTHON", "/tmp/vf_venv/bin/python")
EXAMPLE = os.path.join(ROOT, "scaleout", "verifiers_countdown.py")


def _verifiers_version():
    if not os.path.isfile(VF_PYTHON):
        return None
    try:
        out = subprocess.run([VF_PYTHON, "-c", "import verifiers, renderers, transformers; "
                              "print(verifiers.__version__)"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


VERSION = _verifiers_version()
needs_verifiers = pytest.mark.skipif(VERSION != "0.4.0", reason=f"no verifiers 0.4.0 at "
                                     f"{VF_PYTHON} (bash scaleout/install_verifiers.sh)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf_model")
    model_dir(str(path), 1)
    served = Served(str(path))
    yield served
    served.stop()


# verifiers' own chat program, a process per turn, one episode at a time; the in-process
# harness, 2 episodes of each task at once (each episode then finds its own responses
# among all the server sent: claim())
HARNESSES = [dict(harness="null", group_size=1, concurrency=1),
             dict(harness="inprocess", group_size=2, concurrency=4)]


def episodes(server, turns, num_tasks, harness, group_size, concurrency):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([VF_PYTHON, EXAMPLE, f"--base_url={server.url}", f"--turns={turns}",
                          f"--num_tasks={num_tasks}", "--max_tokens=8", "--json",
                          f"--harness={harness}", f"--group_size={group_size}",
                          f"--concurrency={concurrency}"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == num_tasks * group_size, (
        f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}")
    return rows, out


@needs_verifiers
@pytest.mark.parametrize("how", HARNESSES, ids=lambda h: h["harness"])
def test_single_turn_episodes_are_what_the_server_sampled(server, how):
    rows, out = episodes(server, 1, 2, **how)
    for r in rows:
        assert r["ok"], r
        assert r["turns"] == 1 and r["branches"] == 1 and r["bridged"] == 0
        assert 0 < r["num_sampled"] <= 8 and r["reward"] == 0.0   # a random model
    assert out.returncode == 0


@needs_verifiers
@pytest.mark.parametrize("how", HARNESSES, ids=lambda h: h["harness"])
def test_two_turn_episodes_are_one_token_sequence_bridged_by_ids(server, how):
    rows, out = episodes(server, 2, 2, **how)
    for r in rows:
        assert r["ok"], r
        # a random model's first answer is wrong, so the feedback turn always comes
        assert r["turns"] == 2 and r["branches"] == 1 and r["bridged"] == 1, r
        assert len(r["replies"]) == 2
    assert out.returncode == 0


# -----------------------------------------------------------------------------
# without verifiers: the renderers package's own parser of /inference/v1/generate
# (what verifiers' training client runs on our responses), in its own small venv
# (.ci/run makes one; tests/test_templates.py reads the same)

RENDERERS_PYTHON = os.environ.get("RENDERERS_PYTHON", "/tmp/nanorl_renderers_venv/bin/python")
PARSE = """
import json, sys
from renderers.client import _parse_completion_logprobs, parse_generate_response
raw = open(sys.argv[1], "rb").read()
payload = parse_generate_response(raw)
choice = payload["choices"][0]
ids = list(choice["token_ids"])
print(json.dumps({"ids": ids, "logprobs": _parse_completion_logprobs(choice, ids),
                  "prompt": payload.get("prompt_token_ids")}))
"""


def _has_renderers():
    if not os.path.isfile(RENDERERS_PYTHON):
        return False
    out = subprocess.run([RENDERERS_PYTHON, "-c", "import renderers.client"], capture_output=True,
                         timeout=120)
    return out.returncode == 0


@pytest.mark.skipif(not _has_renderers(), reason=f"no renderers package at {RENDERERS_PYTHON}")
def test_the_renderers_parser_reads_our_generate_responses(tmp_path_factory, tmp_path):
    import httpx
    from engine import EngineConfig, InferenceEngine, SamplingParams
    path = tmp_path_factory.mktemp("renderers_model")
    model_dir(str(path), 2)
    served = Served(str(path))
    try:
        prompt = [1, 100, 4, 103, 5, 24, 5, 26]
        r = httpx.post(served.url + "/inference/v1/generate", timeout=60, json={
            "model": str(path), "token_ids": prompt, "sampling_params": {
                "temperature": 0.0, "max_tokens": 8, "logprobs": 1, "skip_special_tokens": False}})
        assert r.status_code == 200, r.text
        raw = tmp_path / "response.json"
        raw.write_bytes(r.content)
        out = subprocess.run([RENDERERS_PYTHON, "-c", PARSE, str(raw)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        parsed = json.loads(out.stdout)
    finally:
        served.stop()
    engine = InferenceEngine(EngineConfig(model_path=str(path), max_model_len=256, num_blocks=64))
    want = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert parsed["prompt"] == prompt and parsed["ids"] == list(want.completion_tokens)
    assert parsed["logprobs"] == pytest.approx(list(want.logprobs), abs=1e-5)


# -----------------------------------------------------------------------------
# train_grpo_async on a verifiers environment: its episodes, collected through a server the
# trainer pushes its weights to, become GRPO groups (scaleout/verifiers_groups.py)


@needs_verifiers
def test_train_grpo_learns_on_a_verifiers_environment(tmp_path):
    # a random tiny model never solves countdown, so the environment's other reward:
    # brevity (a reply of at most 8 characters), which it learns by stopping sooner. The
    # seed and the criterion were fixed before the first run: seed 1337, the mean reward
    # of the last three of 8 iterations above that of the first three
    import train_grpo
    import train_grpo_async
    from test_grpo import TINY, metrics, tiny_config
    model = f"--model={dict(TINY, max_position_embeddings=256)!r}".replace(" ", "")
    args = [model, "--max_new_tokens=12", "--eval_interval=100", "--seed=1337"]
    # a checkpoint of the trainer's shape for the server to load (the trainer then pushes
    # its own starting weights to it)
    train_grpo.main(tiny_config(tmp_path / "init", *args, "--max_iters=1", "--ckpt_interval=1"))
    server = Served(str(tmp_path / "init" / "ckpt"), "--enable_weight_updates=True")
    try:
        command = f"{VF_PYTHON} {EXAMPLE} --reward=brevity"
        train_grpo_async.main(tiny_config(tmp_path / "vf", *args, "--max_iters=8",
                                          f"--rollout_urls={server.url}",
                                          f"--verifiers_cmd={command}", script=train_grpo_async))
    finally:
        assert server.stop() == 0
    rows = [r for r in metrics(tmp_path / "vf") if "rollout/reward_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in rows]
    assert len(rewards) == 8
    assert sum(rewards[-3:]) > sum(rewards[:3]), rewards
    trained = [r for r in rows if "train/loss" in r]
    assert trained and all(r["train/logprob_mismatch"] < 1e-4 for r in trained)
