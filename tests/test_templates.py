"""
The checkpoints users bring, with their own chat templates: fixtures that behave
like Qwen3's thinking template and Llama 3's, through SFT, multi-turn episodes, the
server and GRPO.

Each fixture is a model directory as a real checkpoint ships it: a random tiny model of
the family (written by transformers), a tokenizer with the family's special tokens and
its chat template, and a generation_config.json with the family's stop ids. The
templates are written here from the families' documented behaviour (no downloaded
files), for system, user and assistant messages (tools are not rendered by this stack):
  - Qwen3: ChatML turns; the last assistant turn after the last user query carries a
    think block (an empty one when it has no reasoning), earlier ones are rendered
    without it, so re-rendering a conversation after a new user message is not an
    extension of what was sampled; enable_thinking=False prefills an empty think block
    in the generation prompt; stop ids <|im_end|> and <|endoftext|>.
  - Llama 3 (3.2 Instruct): <|begin_of_text|>, a system block that is always there
    ("Cutting Knowledge Date", "Today Date", pinned to the template's own fallback
    date), header ids around each role, turns closed by <|eot_id|>; stop ids
    <|end_of_text|>, <|eom_id|>, <|eot_id|>.
Where the renderers package (verifiers' and prime-rl's) has a renderer for the family,
the fixtures render as it does and a 3-turn episode's ids equal its bridged ids
(RENDERERS_PYTHON: its own venv, set up by .ci/run; skipped without it outside CI).

    python -m pytest -q tests/test_templates.py
"""

import json
import os
import runpy
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

from tasks import environment
from tasks import guess
import train_grpo
from checkpoint import load_hf_checkpoint, stop_ids_of
from conftest import randomise
from engine import EngineConfig, InferenceEngine, SamplingParams, TrainingSample, sampled_mask
from tasks.environment import Environment
from test_grpo import tiny_config
from tokenizer import (TurnBridge, build_tokenizer, chat_example, chat_ids, chat_prompt_ids,
                       chat_prompt_ids_batch, check_template_kwargs, load_tokenizer, reply_parts,
                       save_tokenizer)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not"
    "(message.content.startswith('<tool_response>') and message.content.endswith("
    "'</tool_response>')) %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role != 'system' %}"
    "{{- raise_exception('unknown chat role: ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{%- set system_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message }}"
    "{{- '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['user', 'assistant'] %}"
    "{{- raise_exception('unknown chat role: ' + message.role) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# per family: its extra tokens (added: plain text pieces; special: control ids), bos /
# eos, the template, generation_config.json's stop ids, the transformers config class,
# and the renderer
FAMILIES = {
    "qwen3": dict(added=["<think>", "</think>", "<tool_call>", "</tool_call>",
                         "<tool_response>", "</tool_response>"],
                  special=[], bos=None, eos="<|im_end|>", template=QWEN3_TEMPLATE,
                  stops=["<|im_end|>", "<|endoftext|>"], end_of_turn="<|im_end|>",
                  config=Qwen3Config, renderer="Qwen3RendererConfig(enable_thinking=False)",
                  kwargs={"enable_thinking": False}),
    "llama3": dict(added=[], special=["<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                                      "<|end_of_text|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", template=LLAMA3_TEMPLATE,
                   stops=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], end_of_turn="<|eot_id|>",
                   config=LlamaConfig, renderer="Llama3RendererConfig()", kwargs={}),
}
SAMPLING = {"temperature": 0.6, "top_p": 0.95}   # a checkpoint's sampling defaults, carried on
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def family_tokenizer(name):
    """The embedded vocabulary with the family's tokens, bos / eos and chat template."""
    spec, tok = FAMILIES[name], build_tokenizer()
    tok.add_tokens(spec["added"])
    tok.add_tokens(spec["special"], special_tokens=True)
    tok.add_special_tokens({k: v for k, v in (("bos_token", spec["bos"]),
                                              ("eos_token", spec["eos"])) if v})
    tok.chat_template = spec["template"]
    return tok


def write_family_dir(name, path, seed=0):
    """A model directory of the family: random weights whose head favours the stop ids (so
    a random model ends its replies and plays several turns), tokenizer,
    generation_config.json."""
    tok, spec = family_tokenizer(name), FAMILIES[name]
    stops = [tok.convert_tokens_to_ids(t) for t in spec["stops"]]
    torch.manual_seed(seed)
    hf = randomise(AutoModelForCausalLM.from_config(spec["config"](
        vocab_size=len(tok), eos_token_id=stops, **SHAPE)), seed)
    with torch.no_grad():
        hf.lm_head.weight[stops] *= 6.0
    hf.save_pretrained(path)
    save_tokenizer(tok, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stops, "pad_token_id": tok.pad_token_id, **SAMPLING}, f)
    return str(path)


pytestmark = pytest.mark.usefixtures("one_thread")   # conftest: tiny models on one thread


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = write_family_dir(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, load_tokenizer(path)


def ids_of(tok, names):
    return [tok.convert_tokens_to_ids(t) for t in names]


CONVERSATIONS = [
    [{"role": "user", "content": "guess 1 to 40"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "guess 1 to 40"}],
    [{"role": "user", "content": "guess 1 to 40"}, {"role": "assistant", "content": "17"},
     {"role": "user", "content": "17 is too low: 18 to 40"}],
    [{"role": "user", "content": "a"},
     {"role": "assistant", "content": "<think>\nplan\n</think>\n\n17"},
     {"role": "user", "content": "b"}, {"role": "assistant", "content": "20"}],
]


# -----------------------------------------------------------------------------
# the fixtures behave like the families


def test_the_stop_ids_are_the_generation_configs_and_the_engine_stops_on_each(family):
    name, path, tok = family
    stops = ids_of(tok, FAMILIES[name]["stops"])
    assert list(stop_ids_of(path, tok)) == stops and len(stops) >= 2
    engine = InferenceEngine(EngineConfig(model_path=path, max_model_len=256, num_blocks=256))
    prompt = chat_prompt_ids(tok, CONVERSATIONS[0])
    samples = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=0,
                                                       stop_token_ids=frozenset(stops)), 64)
    for stop in stops:   # each stop id ends a reply where it is sampled, and nothing else does
        ended = [s for s in samples if s.completion_tokens[-1] == stop]
        assert ended and all(s.finish_reason == "stop" for s in ended)
    assert all(not set(s.completion_tokens[:-1]) & set(stops) for s in samples)


def test_qwen3_renders_history_without_think_blocks_so_it_is_not_prefix_stable():
    tok = family_tokenizer("qwen3")
    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "17"}]
    sampled = tok.decode(chat_ids(tok, turn, False))
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n17<|im_end|>" in sampled
    later = tok.decode(chat_ids(tok, turn + [{"role": "user", "content": "b"}], True))
    assert "<|im_start|>assistant\n17<|im_end|>" in later and not later.startswith(sampled)
    off = tok.decode(chat_prompt_ids(tok, turn[:1], enable_thinking=False))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


RENDERERS_PYTHON = os.environ.get("RENDERERS_PYTHON", "/tmp/nanorl_renderers_venv/bin/python")


def _has_renderers():
    if not os.path.isfile(RENDERERS_PYTHON):
        return False
    out = subprocess.run([RENDERERS_PYTHON, "-c", "import renderers, transformers"],
                         capture_output=True, timeout=120)
    return out.returncode == 0


needs_renderers = pytest.mark.skipif(not (_has_renderers() or os.environ.get("CI")),
                                     reason=f"no renderers + transformers at {RENDERERS_PYTHON}")

# runs in the renderers venv: render or bridge with the family's renderer on
# the fixture's tokenizer
RENDER = """
import json, sys
from transformers import PreTrainedTokenizerFast
from renderers import create_renderer, Llama3RendererConfig, Qwen3RendererConfig
job = json.load(sys.stdin)
tok = PreTrainedTokenizerFast.from_pretrained(job["path"])
renderer = create_renderer(tok, eval(job["config"]))
out = {"renders": [renderer.render_ids(m, add_generation_prompt=g) for m, g in job["renders"]],
       "bridges": []}
for prompt, completion, new in job["bridges"]:
    bridged = renderer.bridge_to_next_turn(prompt, completion, new)
    out["bridges"].append(None if bridged is None else bridged.token_ids)
print(json.dumps(out))
"""


def renderers_do(path, config, renders=(), bridges=()):
    job = {"path": path, "config": config, "renders": list(renders), "bridges": list(bridges)}
    out = subprocess.run([RENDERERS_PYTHON, "-c", RENDER], input=json.dumps(job),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@needs_renderers
def test_the_fixture_templates_render_as_the_renderers_package_does(family):
    name, path, tok = family
    # the renderer's defaults: Qwen3 with thinking on (its enable_thinking=False
    # re-emits empty think blocks in history, a documented deviation from the template),
    # Llama 3's pinned date
    config = "Qwen3RendererConfig()" if name == "qwen3" else FAMILIES[name]["renderer"]
    jobs = [(m, g) for m in CONVERSATIONS for g in (True, False) if g or
            m[-1]["role"] == "assistant"]
    got = renderers_do(path, config, renders=jobs)["renders"]
    for (messages, generation), theirs in zip(jobs, got):
        assert chat_ids(tok, messages, generation) == theirs, (messages, generation)
    # transformers' own apply_chat_template on the directory agrees too
    hf = AutoTokenizer.from_pretrained(path)
    for messages, generation in jobs:
        assert list(hf.apply_chat_template(messages, add_generation_prompt=generation,
                                           return_dict=False)) == chat_ids(tok, messages,
                                                                           generation)


# -----------------------------------------------------------------------------
# SFT: the mask is the template's assistant turn, up to its end-of-turn id


@pytest.mark.parametrize("thinking", [True, False])
def test_sft_mask_covers_the_turn_as_the_template_renders_it(family, thinking):
    name, path, tok = family
    spec, stops = FAMILIES[name], stop_ids_of(path, tok)
    kwargs = {} if thinking else spec["kwargs"]
    for messages in (CONVERSATIONS[0], CONVERSATIONS[2]):
        ids, mask = chat_example(tok, messages + [{"role": "assistant", "content": "23"}], stops,
                                 **kwargs)
        prompt = chat_prompt_ids(tok, messages, **kwargs)
        learned = [t for t, m in zip(ids, mask) if m]
        assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
        assert mask[len(prompt):len(prompt) + len(learned)] == [1] * len(learned)
        think = "<think>\n\n</think>\n\n" if name == "qwen3" and thinking else ""
        assert tok.decode(learned) == think + "23" + spec["end_of_turn"]
        assert learned[-1] in stops and not any(mask[len(prompt) + len(learned):])


# -----------------------------------------------------------------------------
# multi-turn episodes: by ids, as sampled


class Recording:
    """The engine, recording the prompts each turn sends and the samples it returns."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, params, num_samples=1, first_index=0):
        out = self.engine.generate(prompts, params, num_samples, first_index)
        self.calls.append(([list(p) for p in prompts], out))
        return out


def guessing_episodes(path, tok, kwargs, n=8):
    env = Environment(guess, tok, max_new_tokens=6, max_turns=3, max_episode_tokens=200,
                      stop_ids=stop_ids_of(path, tok), template_kwargs=kwargs)
    problems = guess.make_problems("train", n)
    engine = Recording(InferenceEngine(EngineConfig(model_path=path, max_model_len=512,
                                                    num_blocks=256)))
    return env, engine, env.episodes(engine, problems, num_samples=4, temperature=1.0, seed=3)


def replies_of(engine, e):
    """The samples that made episode e, one per turn, found among what the engine
    returned: the one whose prompt is the episode so far and whose reply comes next in
    it."""
    whole, ids, replies = e.prompt + e.ids, list(e.prompt), []
    samples = [s for _, out in engine.calls for s in out]
    for turn in range(e.turns):
        s = next(s for s in samples if list(s.prompt_tokens) == ids and
                 whole[len(ids):len(ids) + len(s.completion_tokens)] == list(s.completion_tokens))
        replies.append(s)
        ids = whole[:len(ids) + len(s.completion_tokens)]
        if turn + 1 < e.turns:   # the next prompt: the engine got it from the episode
            ids = list(next(s.prompt_tokens for s in samples if len(s.prompt_tokens) > len(ids)
                            and list(s.prompt_tokens[:len(ids)]) == ids
                            and whole[:len(s.prompt_tokens)] == list(s.prompt_tokens)))
    return replies


@pytest.mark.parametrize("thinking", [False, True])
def test_an_episode_is_what_the_engine_sampled_plus_the_templates_new_turns(family, thinking):
    name, path, tok = family
    kwargs = {} if thinking else FAMILIES[name]["kwargs"]   # Qwen3: thinking on, and off
    env, engine, episodes = guessing_episodes(path, tok, kwargs)
    assert max(e.turns for e in episodes) == 3   # the fixture's random model plays 3 turns
    bridge = TurnBridge(tok, env.stop, **kwargs)
    for e in episodes:
        # rebuilt by appending: each reply exactly as sampled, then the template's ids for
        # only the environment's new message (TurnBridge, with no episode state)
        users = [m for m in e.messages[1:] if m["role"] == "user"]
        ids, replies = list(e.prompt), replies_of(engine, e)
        for turn, s in enumerate(replies):
            ids += list(s.completion_tokens)
            if turn + 1 < e.turns:
                ids += bridge.next_ids([users[turn]], s.completion_tokens[-1])
        assert ids == e.prompt + e.ids
        # the loss mask is 1 exactly on the sampled ids
        assert [t for t, m in zip(e.ids, e.mask) if m] == \
            [t for s in replies for t in s.completion_tokens]
        assert list(sampled_mask(e.sample())) == e.mask


def test_three_turn_episodes_logprobs_are_the_trainers(family):
    name, path, tok = family
    env, _, episodes = guessing_episodes(path, tok, FAMILIES[name]["kwargs"])
    model = load_hf_checkpoint(path)
    three = [e for e in episodes if e.turns == 3]
    assert three
    for e in three[:4]:
        seq = torch.tensor(e.prompt + e.ids)
        with torch.no_grad():
            logits = model.logits(model(seq, torch.arange(len(seq)))[0])[len(e.prompt) - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(e.ids)[:, None])[:, 0]
        on = torch.tensor(e.mask, dtype=torch.bool)
        assert (lp[on] - torch.tensor(e.logprobs)[on]).abs().max().item() < 1e-5
        assert not any(e.logprobs[i] for i in range(len(e.ids)) if not e.mask[i])


@needs_renderers
def test_a_three_turn_episodes_ids_equal_the_renderers_bridged_ids(family):
    name, path, tok = family
    _, engine, episodes = guessing_episodes(path, tok, FAMILIES[name]["kwargs"])
    three = [e for e in episodes if e.turns == 3][:3]
    assert three
    renders, bridges, ours = [], [], []
    for e in three:
        users = [m for m in e.messages[1:] if m["role"] == "user"]
        renders.append((e.messages[:1], True))
        replies, whole = replies_of(engine, e), e.prompt + e.ids
        for turn in range(2):   # turn 2's and turn 3's prompts, as the episode holds them
            prompt = list(replies[turn].prompt_tokens)
            bridges.append((prompt, list(replies[turn].completion_tokens), [users[turn]]))
            ours.append(list(replies[turn + 1].prompt_tokens))
            assert whole[:len(ours[-1])] == ours[-1]
    got = renderers_do(path, FAMILIES[name]["renderer"], renders, bridges)
    assert got["renders"] == [e.prompt for e in three]
    assert got["bridges"] == ours


def test_a_thinking_reply_is_split_and_the_reward_sees_its_content(family):
    name, path, tok = family
    text = "<think>\nhalve it\n</think>\n\n23"
    if name == "qwen3":   # a template with a </think> token: reasoning apart, content for the task
        assert reply_parts(tok, text) == ("halve it", "23")
        assert reply_parts(tok, "23") == (None, "23")
    else:                 # no such token: the whole text is content
        assert reply_parts(tok, text) == (None, text)
    # in an episode: the guessing game scores the content, the history keeps the reasoning
    env = Environment(guess, tok, max_new_tokens=16, stop_ids=stop_ids_of(path, tok))
    stop = tok.convert_tokens_to_ids(FAMILIES[name]["end_of_turn"])
    reply = tok.encode(text, add_special_tokens=False) + [stop]
    sample = TrainingSample((1,), tuple(reply), (0.0,) * len(reply), finish_reason="stop")
    (problem,) = [p for p in guess.make_problems("train") if p.secret == 23][:1]
    e = environment.Episode(problem, guess.prompt_messages(problem), [1])
    env.take_reply(e, sample, 1)
    assert e.reward == (1.0 if name == "qwen3" else 0.0)
    if name == "qwen3":
        assert e.messages[-1] == {"role": "assistant", "content": "23",
                                  "reasoning_content": "halve it"}


def test_prompts_rendered_in_one_batch_are_the_one_at_a_time_ids(family, monkeypatch):
    name, _, tok = family
    kwargs = FAMILIES[name].get("kwargs", {})
    calls, render = [], tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: calls.append(1) or
                        render(*a, **k))
    for extra in ({}, kwargs):   # the template's own kwargs (Qwen3's enable_thinking) too
        one = [chat_prompt_ids(tok, c, **extra) for c in CONVERSATIONS[:3]]
        calls.clear()
        assert chat_prompt_ids_batch(tok, CONVERSATIONS[:3], **extra) == one
        assert len(calls) == 1   # one batched call, not the one-at-a-time fallback
    assert chat_prompt_ids_batch(tok, []) == []
    # a conversation the template refuses is named, as one at a time
    strict = family_tokenizer(name)
    strict.chat_template = ("{%- for m in messages %}{%- if loop.index0 > 0 and m.role == "
                            "messages[loop.index0 - 1].role %}{{- raise_exception('roles must "
                            "alternate') }}{%- endif %}{%- endfor %}" + FAMILIES[name]["template"])
    two_users = [{"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match=r"cannot render roles \['user', 'user'\].*alternate"):
        chat_prompt_ids_batch(strict, [CONVERSATIONS[0], two_users])


def test_a_template_that_cannot_render_a_conversation_is_refused_naming_its_failure(family):
    name, path, tok = family
    with pytest.raises(ValueError, match="unknown chat role: critic"):
        chat_ids(tok, [{"role": "critic", "content": "x"}], True)
    strict = family_tokenizer(name)   # a template that refuses two user messages in a row
    strict.chat_template = ("{%- for m in messages %}{%- if loop.index0 > 0 and m.role == "
                            "messages[loop.index0 - 1].role %}{{- raise_exception('roles must "
                            "alternate') }}{%- endif %}{%- endfor %}" + FAMILIES[name]["template"])
    with pytest.raises(ValueError, match="roles must alternate"):
        chat_ids(strict, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                 True)
    env = Environment(guess, strict, max_new_tokens=6, max_turns=3, max_episode_tokens=200,
                      stop_ids=stop_ids_of(path, tok))
    two_users = [{"role": "user", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        env.turn_ids(two_users, tok.convert_tokens_to_ids(FAMILIES[name]["end_of_turn"]))


# -----------------------------------------------------------------------------
# the stages and the server on each family


def test_sft_and_a_multi_turn_grpo_step_on_each_family(family, tmp_path, monkeypatch):
    name, path, tok = family
    kwargs = repr(FAMILIES[name]["kwargs"]).replace(" ", "")
    monkeypatch.setattr(sys, "argv", [
        "sft.py", "--task=tasks.guess", f"--init_from={path}", f"--out_dir={tmp_path / 'sft'}",
        "--max_iters=1", "--ckpt_interval=1", "--n_eval_problems=4", "--eval_max_tokens=4",
        "--max_turns=3", "--max_episode_tokens=64", "--eval_interval=1", "--batch_tokens=512",
        "--demo_fraction=0.01", "--keep_best=True", f"--chat_template_kwargs={kwargs}"])
    runpy.run_path(os.path.join(ROOT, "sft.py"), run_name="__main__")
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert any("eval/accuracy" in r for r in rows)
    for out in ("ckpt", "best"):   # a checkpoint keeps the stop ids (and sampling defaults)
        assert stop_ids_of(str(tmp_path / "sft" / out), tok) == stop_ids_of(path, tok)
        kept = json.load(open(tmp_path / "sft" / out / "generation_config.json"))
        assert {k: kept[k] for k in SAMPLING} == SAMPLING
    train_grpo.main(tiny_config(
        tmp_path / "grpo", "--task=tasks.guess", f"--init_from={tmp_path / 'sft' / 'best'}",
        "--max_iters=1", "--ckpt_interval=1", "--prompts_per_step=8", "--group_size=4",
        "--max_new_tokens=4", "--max_turns=3", "--max_episode_tokens=64", "--n_eval_problems=4",
        "--pass_k=0", "--eval_interval=1", f"--chat_template_kwargs={kwargs}"))
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert any(r.get("rollout/turns_mean", 0) > 1 for r in rows)
    assert any("eval/accuracy" in r for r in rows)
    assert stop_ids_of(str(tmp_path / "grpo" / "ckpt"), tok) == stop_ids_of(path, tok)


def test_serve_py_renders_as_transformers_and_stops_on_the_templates_end_of_turn(family):
    from test_serve import Served
    name, path, tok = family
    hf = AutoTokenizer.from_pretrained(path)
    stops = ids_of(tok, FAMILIES[name]["stops"])
    server = Served(path)
    try:
        card = httpx.get(server.url + "/v1/models").json()["data"][0]
        assert card["stop_token_ids"] == sorted(stops)
        for kwargs in ({}, FAMILIES[name]["kwargs"]):
            r = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": CONVERSATIONS[2], "max_tokens": 24, "temperature": 1.0, "seed": 1,
                "n": 8, "return_token_ids": True, "chat_template_kwargs": kwargs}).json()
            want = hf.apply_chat_template(CONVERSATIONS[2], add_generation_prompt=True,
                                          return_dict=False, **kwargs)
            assert r["prompt_token_ids"] == list(want)
            stopped = [c for c in r["choices"] if c["finish_reason"] == "stop"]
            assert stopped and all(c["token_ids"][-1] in stops for c in stopped)
        for kwargs, named in (({"thinking_budget": 5}, "thinking_budget"),
                              ({"content": "x"}, "content"), ([], "dict")):
            bad = httpx.post(server.url + "/v1/chat/completions", json={
                "messages": CONVERSATIONS[0], "max_tokens": 4, "chat_template_kwargs": kwargs})
            assert bad.status_code == 400 and named in bad.json()["error"]["message"]
        # a name the template sets itself would be overwritten: refused; one
        # it reads, honoured
        own = "content" if name == "qwen3" else "system_message"
        with pytest.raises(ValueError, match=own):
            check_template_kwargs(tok, {own: "x"})
        read = {"enable_thinking": False} if name == "qwen3" else {"date_string": "1 Jan 2026"}
        assert check_template_kwargs(tok, read) == read
    finally:
        assert server.stop() == 0


# -----------------------------------------------------------------------------
# the real case: config/gsm8k.py on a family's checkpoint and GSM8K-shaped JSONL


def test_the_gsm8k_config_runs_sft_and_grpo_on_each_familys_checkpoint(family, tmp_path,
                                                                        monkeypatch):
    from configurator import configure
    from tasks import make_gsm8k_like
    name, path, tok = family
    make_gsm8k_like.main(str(tmp_path / "data"), n_train=240, n_test=8)
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "data"))
    cpu = ["--device=cpu", "--dtype=float32", "--batch_tokens=1024", "--n_eval_problems=4",
           "--eval_interval=2", "--ckpt_interval=2", "--max_iters=2"]
    monkeypatch.setattr(sys, "argv", [
        "sft.py", "config/gsm8k.py", f"--init_from={path}", f"--out_dir={tmp_path / 'sft'}",
        "--eval_max_tokens=8", "--demo_fraction=0.05", *cpu])
    runpy.run_path(os.path.join(ROOT, "sft.py"), run_name="__main__")
    rows = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    assert [r["iter"] for r in rows if "train/loss" in r][-1] == 2
    assert any("eval/accuracy" in r for r in rows)
    settings = {k: v for k, v in vars(train_grpo).items() if not k.startswith("_")}
    config = configure(settings, ["config/gsm8k.py", f"--init_from={tmp_path / 'sft' / 'best'}",
                                  f"--out_dir={tmp_path / 'grpo'}", "--engine_dtype=float32",
                                  "--max_new_tokens=8", "--prompts_per_step=4", "--group_size=4",
                                  "--pass_k=0", *cpu], stage="grpo")
    train_grpo.main(config)
    rows = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [r["iter"] for r in rows if "rollout/problems" in r] == [1, 2]
    assert stop_ids_of(str(tmp_path / "grpo" / "ckpt"), tok) == stop_ids_of(path, tok)
