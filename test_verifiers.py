"""
verifiers 0.4.0 collecting countdown episodes through serve.py (examples/verifiers_countdown.py):
its training client, the `null` harness and the example's ChatML renderer, which bridges a next
turn by token ids. What verifiers records per episode (Trace.branches: token ids, sampled mask,
logprobs) must be, token for token, what the server sampled, for single-turn and 2-turn episodes.

verifiers lives in its own venv (examples/install_verifiers.sh, default /tmp/vf_venv; VF_PYTHON
names another interpreter), so the example runs there in a subprocess against a serve.py on a random
tiny checkpoint. Skipped when that interpreter is missing or cannot import verifiers 0.4.0. The
null harness's chat program is a uv script: its first run fetches openai, mcp, ... from PyPI into
verifiers' cache.
"""

import json
import os
import subprocess

import pytest

from test_serve import Served, model_dir

HERE = os.path.dirname(os.path.abspath(__file__))
VF_PYTHON = os.environ.get("VF_PYTHON", "/tmp/vf_venv/bin/python")
EXAMPLE = os.path.join(HERE, "examples", "verifiers_countdown.py")


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
pytestmark = pytest.mark.skipif(VERSION != "0.4.0", reason=f"no verifiers 0.4.0 at {VF_PYTHON} "
                                "(bash examples/install_verifiers.sh)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf_model")
    model_dir(str(path), 1)
    served = Served(str(path))
    yield served
    served.stop()


def episodes(server, turns, num_tasks):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([VF_PYTHON, EXAMPLE, f"--base_url={server.url}", f"--turns={turns}",
                          f"--num_tasks={num_tasks}", "--max_tokens=8", "--json"],
                         capture_output=True, text=True, timeout=900, env=env, cwd=HERE)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == num_tasks, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    return rows, out


def test_single_turn_episodes_are_what_the_server_sampled(server):
    rows, out = episodes(server, 1, 2)
    for r in rows:
        assert r["ok"], r
        assert r["turns"] == 1 and r["branches"] == 1 and r["bridged"] == 0
        assert 0 < r["num_sampled"] <= 8 and r["reward"] == 0.0   # a random model
    assert out.returncode == 0


def test_two_turn_episodes_are_one_token_sequence_bridged_by_ids(server):
    rows, out = episodes(server, 2, 2)
    for r in rows:
        assert r["ok"], r
        # a random model's first answer is wrong, so the feedback turn always comes
        assert r["turns"] == 2 and r["branches"] == 1 and r["bridged"] == 1, r
        assert len(r["replies"]) == 2
    assert out.returncode == 0
