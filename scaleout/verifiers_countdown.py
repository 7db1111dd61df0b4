"""
The countdown task as a verifiers 0.4.0 environment, its episodes collected through
scaleout/serve.py the way prime-rl trains with verifiers: a harness plays the task
(ChatHarness below, verifiers' tool-less `null` chat program's one request per turn run
in this process; --harness=null runs verifiers' own program, a process per turn), 64
episodes at a time (--concurrency), verifiers' interception server hands each of its
chat requests to the training client (`vf.TrainClientConfig` -> `TrainClient`), which
renders the conversation to token ids with a renderer and calls scaleout/serve.py's
vLLM-style token-in / token-out `POST /inference/v1/generate`. The
renderer is ChatMLRenderer below: the checkpoint's ChatML template, and a next turn is
bridged by token ids (the previous prompt + the ids sampled + the template's ids for
the new user turn), as client.next_turn_prompt does, so an episode is one token
sequence the model actually produced.

    bash scaleout/install_verifiers.sh                     # a venv with verifiers==0.4.0 (+ uv)
    python -m scaleout.serve --model_path=out/qwen_small/grpo/ckpt --port=8123 &
    # once GET :8123/health answers (it compiles its decode step first)
    /tmp/vf_venv/bin/python scaleout/verifiers_countdown.py --base_url=http://127.0.0.1:8123
    /tmp/vf_venv/bin/python scaleout/verifiers_countdown.py --turns=2 --num_tasks=3

Without a trained checkpoint, a random tiny one does (every answer wrong, so 2-turn
episodes are 2 turns):

    python -c "from tests import test_serve; test_serve.model_dir('/tmp/vf_model', 1)"
    python -m scaleout.serve --model_path=/tmp/vf_model --port=8123 --max_model_len=256 &

Per episode it prints the reward and whether what verifiers recorded (`Trace.branches`:
one token sequence per branch, `sampled_mask`, `logprobs`) is, token for token, what
scaleout/serve.py sent back (each response's prompt_token_ids, choices[0].token_ids and
their logprobs, captured as the renderers package parses them; episodes run at once, so
each is matched to its own responses: claim()). With --json it prints one JSON line per
episode instead (test_verifiers.py reads those), its branch included:
scaleout/verifiers_groups.py turns those into GRPO groups. Exit status 1 if any
episode differs or failed, or a response is in no episode.

The repo's countdown.py / countdown_feedback.py are imported from the repository root
(put on sys.path here), so PYTHONPATH need not be set. The
null harness runs its chat program through `uv` (PyPI packages: openai, mcp, httpx, ...;
fetched once into verifiers' cache), so uv must be on PATH: this file prepends its
interpreter's bin directory, where install_verifiers.sh puts uv. ChatHarness needs
neither.
"""

import argparse
import asyncio
import json
import os
import sys
from typing import Any, Literal

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# verifiers finds a taskset (and the renderer config names a renderer) by module name: make
# this file importable as `verifiers_countdown` and, run as a script, be that very module
MODULE = "verifiers_countdown"
if __name__ == "__main__":
    sys.modules.setdefault(MODULE, sys.modules["__main__"])
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# the null harness's chat program is a uv script: find the uv installed next
# to this interpreter
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import httpx  # noqa: E402
import renderers.client  # noqa: E402
import verifiers.v1 as vf  # noqa: E402
from renderers import ParsedResponse, RenderedTokens  # noqa: E402
from renderers.base import reject_assistant_in_extension, trim_to_turn_close  # noqa: E402
from renderers.configs import BaseRendererConfig, CustomRendererConfig  # noqa: E402
from verifiers.v1.dialects.chat import message_to_wire  # noqa: E402
from verifiers.v1.runtimes import SubprocessConfig  # noqa: E402

from tasks import countdown  # noqa: E402
from tasks import countdown_feedback  # noqa: E402

# what verifiers' loaders look up: the taskset, and the harness for `harness.id=MODULE`
__all__ = ["CountdownTaskset", "ChatHarness"]

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


# -----------------------------------------------------------------------------
# the renderer: the repo's ChatML template, by token ids


class ChatMLRendererConfig(BaseRendererConfig):
    """ChatMLRenderer's config (no knobs)."""

    name: Literal["nanorl-chatml"] = "nanorl-chatml"


class ChatMLRenderer:
    """A `renderers.Renderer` for tokenizer.py's Qwen-style ChatML template:

        <|im_start|>ROLE\\nCONTENT<|im_end|>\\n ... <|im_start|>assistant\\n

    render() builds the ids message by message (for the per-token attribution verifiers
    keeps) and checks them against the tokenizer's own chat template;
    bridge_to_next_turn() continues the previous prompt + completion by ids, never
    re-tokenizing what was sampled."""

    config_class = ChatMLRendererConfig
    supports_tools = False
    bridged: set[tuple[int, ...]] = set()   # the next-turn prompts bridged by ids

    def __init__(self, tokenizer, config: ChatMLRendererConfig | None = None):
        self.tokenizer, self.config = tokenizer, config or ChatMLRendererConfig()
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (IM_START, IM_END, ENDOFTEXT)}
        self.im_start, self.im_end, self.endoftext = ids[IM_START], ids[IM_END], ids[ENDOFTEXT]

    @property
    def is_prefix_stable(self) -> bool:
        return True

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _emit(self, messages, start_index=0):
        """(ids, message_indices, sampled_mask, is_content) of messages + the generation
        prompt."""
        ids, index, sampled, content = [], [], [], []

        def put(toks, i, is_sampled=False, is_content=False):
            ids.extend(toks)
            index.extend([i] * len(toks))
            sampled.extend([is_sampled] * len(toks))
            content.extend([is_content] * len(toks))

        for i, m in enumerate(messages, start_index):
            role, text = m.get("role"), m.get("content") or ""
            if role not in ("system", "user", "assistant"):
                raise ValueError(f"the ChatML template has no role {role!r}")
            if not isinstance(text, str):
                text = "".join(p.get("text", "") for p in text)
            put([self.im_start] + self._encode(role + "\n"), i)
            put(self._encode(text), i, role == "assistant", True)
            put([self.im_end], i, role == "assistant")
            put(self._encode("\n"), i)
        put([self.im_start] + self._encode("assistant\n"), -1)
        return ids, index, sampled, content

    def render(self, messages, *, tools=None, add_generation_prompt=False, **_) -> RenderedTokens:
        if tools:
            raise ValueError("the ChatML template of this repo has no tools")
        ids, index, sampled, content = self._emit(messages)
        if not add_generation_prompt:   # drop the generation prompt _emit ends with
            n = 1 + len(self._encode("assistant\n"))
            ids, index, sampled, content = ids[:-n], index[:-n], sampled[:-n], content[:-n]
        wire = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        want = self.tokenizer.apply_chat_template(
            wire, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
        want = list(want["input_ids"] if isinstance(want, dict) else want)
        if ids != want:
            raise ValueError(f"ChatMLRenderer disagrees with the chat template: {ids} vs {want}")
        return RenderedTokens(token_ids=ids, message_indices=index, sampled_mask=sampled,
                              is_content=content, message_roles=[m["role"] for m in messages],
                              message_tool_names=[None] * len(messages))

    def render_ids(self, messages, *, tools=None, add_generation_prompt=False, **_) -> list[int]:
        return self.render(messages, tools=tools,
                           add_generation_prompt=add_generation_prompt).token_ids

    def get_stop_token_ids(self) -> list[int]:
        # tokenizer.generation_stop_ids, /v1/models says so
        return [self.im_end, self.endoftext]

    def parse_response(self, token_ids, *, tools=None, prompt_ids=None) -> ParsedResponse:
        ids = list(token_ids)
        if ids and ids[-1] in self.get_stop_token_ids():
            ids = ids[:-1]
        return ParsedResponse(content=self.tokenizer.decode(ids, skip_special_tokens=False))

    def bridge_to_next_turn(self, previous_prompt_ids, previous_completion_ids, new_messages, *,
                            tools=None, **_) -> RenderedTokens | None:
        """previous prompt + completion (closed by <|im_end|>, added if it
        was cut off at max_tokens) + "\\n" + the new messages + the
        generation prompt: client.next_turn_prompt."""
        if not previous_prompt_ids or not new_messages or tools:
            return None
        if reject_assistant_in_extension(new_messages):
            return None
        previous = trim_to_turn_close(previous_prompt_ids, previous_completion_ids,
                                      {self.im_end, self.endoftext}, synthesize_close=self.im_end)
        if previous is None:
            return None
        newline = self._encode("\n")
        ids, index, sampled, content = self._emit(new_messages)
        n = len(previous) + len(newline)
        ChatMLRenderer.bridged.add(tuple(previous + newline + ids))
        return RenderedTokens(token_ids=previous + newline + ids, message_indices=[-1] * n + index,
                              sampled_mask=[False] * (n + len(ids)),
                              is_content=[False] * n + content,
                              message_roles=[m["role"] for m in new_messages],
                              message_tool_names=[None] * len(new_messages))


# -----------------------------------------------------------------------------
# the taskset: countdown problems, scored by countdown.reward


class CountdownData(vf.TaskData):
    digits: list[int]
    target: int
    reward: str = "countdown"   # REWARDS' key

    @property
    def problem(self) -> countdown.Problem:
        return countdown.Problem(digits=tuple(self.digits), target=self.target)


# what an answer earns: countdown's reward, or (--reward=brevity, for a random tiny model,
# which never solves countdown but can learn to stop) 1.0 for a reply of at most 8 characters
REWARDS = {"countdown": countdown.reward, "brevity": lambda problem, text: float(len(text) <= 8)}


class CountdownTask(vf.Task[CountdownData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 if any answer of the episode is right (countdown_feedback.episode_reward)."""
        answers = [m.content or "" for m in trace.assistant_messages]
        reward = REWARDS[self.data.reward]
        return max((reward(self.data.problem, a) for a in answers), default=0.0)


class CountdownConfig(vf.TasksetConfig):
    split: str = "test"
    num_tasks: int = 4
    offset: int = 0   # the split's problems from this one on (wrapping round)
    reward: str = "countdown"


class CountdownTaskset(vf.Taskset[CountdownTask, CountdownConfig]):
    def load(self):
        split = countdown.make_problems(self.config.split)
        for i in range(self.config.num_tasks):
            p = split[(self.config.offset + i) % len(split)]
            name = f"{' '.join(map(str, p.digits))}->{p.target}"
            data = CountdownData(prompt=countdown.prompt_messages(p), digits=list(p.digits),
                                 target=p.target, name=name, reward=self.config.reward)
            yield CountdownTask(data, self.config.task)


# -----------------------------------------------------------------------------
# the harness: verifiers' `null` chat program, run in this process


class ChatHarnessConfig(vf.HarnessConfig):
    id: str = MODULE


class ChatHarness(vf.Harness[ChatHarnessConfig]):
    """What the `null` harness's program does with a tool-less task (one chat completion
    per segment, through the interception endpoint), as a coroutine in this process.
    verifiers' Harness.launch allows it ("the interception is the contract, not the
    process"); the `null` harness starts a uv program per segment, which on two cores
    costs more than sampling the episode. --harness=null runs verifiers' own."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True   # a next turn relaunches on the conversation, as `null` does
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as client:
            r = await client.post(endpoint.rstrip("/") + "/chat/completions",
                                  json={"model": ctx.model, "messages": messages},
                                  headers={"Authorization": f"Bearer {secret}"})
        ok = r.status_code == 200
        return vf.ProgramResult(exit_code=0 if ok else 1, stdout="",
                                stderr="" if ok else f"{r.status_code}: {r.text}")


# -----------------------------------------------------------------------------
# the two environments: one answer, or an answer, the feedback, a second answer


HARNESSES = {"inprocess": MODULE, "null": "null"}   # --harness: ChatHarness or verifiers' own


def agent_config(turns, harness="inprocess"):
    return vf.AgentConfig(harness={"id": HARNESSES[harness]}, runtime=SubprocessConfig(),
                          max_turns=turns, network_notice=False)


class FeedbackEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = agent_config(2)
    turns: int = 2


class FeedbackEnv(vf.Env[FeedbackEnvConfig]):
    """Countdown with feedback (countdown_feedback.py): after a wrong answer the
    environment says what it came to and the model answers again, up to `turns` answers,
    all in one conversation."""

    async def run(self, t, agents):
        problem = t.data.problem
        messages = [dict(m) for m in countdown.prompt_messages(problem)]
        async with agents.agent.interaction(t) as chat:
            segment = await chat.turn()   # the task's prompt opens the exchange
            for _ in range(self.config.turns - 1):
                if segment.terminated:
                    break
                messages.append({"role": "assistant", "content": segment.last_reply})
                reply = countdown_feedback.env_response(problem, messages)
                if reply is None:   # right: the episode is over
                    break
                messages += reply
                segment = await chat.turn(reply)


def make_env(args):
    """The environment main's arguments ask for: its tasks, turns and harness."""
    taskset = {"id": MODULE, "num_tasks": args.num_tasks, "split": args.split,
               "offset": args.offset, "reward": args.reward}
    agent = agent_config(args.turns, args.harness)
    if args.turns == 1:
        return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset=taskset, agent=agent))
    return FeedbackEnv(FeedbackEnvConfig(taskset=taskset, agent=agent, turns=args.turns))


# -----------------------------------------------------------------------------
# collecting, and checking what verifiers recorded against what the server sent


SERVER_RESPONSES: list[dict] = []   # every /inference/v1/generate response, as the server sent it
_parse = renderers.client.parse_generate_response


def _recording_parse(raw: bytes) -> dict[str, Any]:
    data = _parse(raw)
    SERVER_RESPONSES.append(json.loads(raw))
    return data


renderers.client.parse_generate_response = _recording_parse


def compare(trace, responses) -> dict:
    """Whether trace's branches are, token for token, the server's responses in order:
    each response's prompt + completion a prefix of the branch, the completions exactly
    its sampled tokens, their logprobs the server's, and the last response ending the
    branch."""
    out = {"turns": len(responses), "branches": len(trace.branches),
           "ok": True, "why": ""}

    def fail(why):
        out.update(ok=False, why=out["why"] or why)

    if len(trace.branches) != 1:
        fail(f"{len(trace.branches)} branches, expected 1 (one conversation)")
    if not responses:
        fail("the server sent nothing")
    if not out["ok"]:
        return out
    b = trace.branches[0]
    ids, mask, lps = b.token_ids, b.sampled_mask, b.logprobs
    want_mask = [False] * len(ids)
    want_lps = [0.0] * len(ids)
    for k, r in enumerate(responses):
        prompt, ch = r["prompt_token_ids"], r["choices"][0]
        done = prompt + ch["token_ids"]
        if ids[:len(done)] != done:
            fail(f"turn {k + 1}: the server's prompt + completion is not a prefix of the branch")
            return out
        for j, entry in enumerate(ch["logprobs"]["content"]):
            want_mask[len(prompt) + j] = True
            want_lps[len(prompt) + j] = entry["logprob"]
        if k and prompt[:len(last)] != last:
            fail(f"turn {k + 1}: its prompt does not continue turn {k}'s ids")
        last = done
    if len(ids) != len(last):
        fail(f"the branch has {len(ids)} tokens, the last response ends at {len(last)}")
    elif mask != want_mask:
        fail("sampled_mask is not exactly the server's completion tokens")
    elif lps != want_lps:
        fail("the logprobs differ from the server's")
    out.update(num_tokens=len(ids), num_sampled=sum(mask))
    return out


def claim(trace, pool) -> list[dict]:
    """The responses in pool that make up trace's (one) branch, taken out of pool, in turn
    order: one per prompt length, whose prompt + completion begins the branch; of several
    such (episodes of one task that sampled the same tokens), the one with the branch's
    logprobs. Episodes run at once, so each finds its own turns among all the server sent;
    compare() then checks what was taken."""
    if len(trace.branches) != 1:
        return []
    branch = trace.branches[0]
    turns = {}   # prompt length -> the response taken for that turn
    for r in pool:
        prompt, ch = r["prompt_token_ids"], r["choices"][0]
        done = prompt + ch["token_ids"]
        if branch.token_ids[:len(done)] != done:
            continue
        sampled = [e["logprob"] for e in ch["logprobs"]["content"]]
        exact = branch.logprobs[len(prompt):len(done)] == sampled
        if exact or len(prompt) not in turns:
            turns[len(prompt)] = r
    mine = [turns[n] for n in sorted(turns)]
    for r in mine:
        pool.remove(r)
    return mine


async def collect(args, model, model_path):
    """Run args.group_size episodes per task (main's arguments), args.concurrency at a
    time (the server batches them); return [(episode, comparison)] in task order, and how
    many of the server's responses are in no episode."""
    renderer = CustomRendererConfig(import_path=f"{MODULE}.ChatMLRenderer")
    client = vf.TrainClientConfig(base_url=args.base_url.rstrip("/") + "/v1",
                                  api_key_var="NANORL_API_KEY", renderer=renderer,
                                  renderer_model_name=model_path)
    sampling = vf.SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    ctx = vf.ModelContext(model=model, client=client, sampling=sampling)
    env = make_env(args)
    slots = asyncio.Semaphore(args.concurrency)

    async def run(t):
        async with slots:
            return await env.run_episode(t, ctx)

    del SERVER_RESPONSES[:]
    async with env.serving():
        episodes = await asyncio.gather(
            *(run(t) for t in env.taskset for _ in range(args.group_size)))
    results = []
    for episode in episodes:
        if not episode.ok or len(episode.traces) != 1:
            errors = [e.message for e in episode.errors] + [
                e.message for tr in episode.traces for e in tr.errors]
            results.append((episode, {"ok": False, "why": f"episode failed: {errors}"}))
            continue
        responses = claim(episode.traces[0], SERVER_RESPONSES)
        bridged = sum(tuple(r["prompt_token_ids"]) in ChatMLRenderer.bridged for r in responses)
        results.append((episode, dict(compare(episode.traces[0], responses), bridged=bridged)))
    return results, len(SERVER_RESPONSES)


def branch_row(trace):
    """The trace's (first) branch as plain data, what scaleout/verifiers_groups.py takes."""
    if trace is None or not trace.branches:
        return None
    b = trace.branches[0]
    return {"token_ids": list(b.token_ids), "sampled_mask": [bool(m) for m in b.sampled_mask],
            "logprobs": [float(x) for x in b.logprobs]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base_url", default="http://127.0.0.1:8123")
    ap.add_argument("--model_path", default="",
                    help="the served model dir ('' = /v1/models' id)")
    ap.add_argument("--turns", type=int, default=1,
                    help="1: single-turn; 2+: with feedback")
    ap.add_argument("--num_tasks", type=int, default=3)
    # a chain of steps (countdown.py)
    ap.add_argument("--max_tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--json", action="store_true", help="one JSON line per episode")
    # what scaleout/verifiers_groups.py asks for when it trains on these episodes
    ap.add_argument("--group_size", type=int, default=1, help="episodes per task")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"])
    ap.add_argument("--offset", type=int, default=0, help="the split's first task")
    ap.add_argument("--reward", default="countdown", choices=sorted(REWARDS))
    ap.add_argument("--harness", default="inprocess", choices=sorted(HARNESSES),
                    help="inprocess: ChatHarness; null: verifiers' chat program, a process each")
    ap.add_argument("--concurrency", type=int, default=64, help="episodes run at once")
    args = ap.parse_args()
    if args.concurrency < 1:
        ap.error(f"--concurrency={args.concurrency}: expected >= 1")
    key = os.environ.get("NANORL_API_KEY", "")   # the server's --api_key, if it has one
    card = httpx.get(args.base_url.rstrip("/") + "/v1/models",
                     headers={"Authorization": f"Bearer {key}"} if key else {}).json()["data"][0]
    model, model_path = card["id"], args.model_path or card["id"]
    results, unclaimed = asyncio.run(collect(args, model, model_path))
    for episode, cmp in results:
        trace = episode.traces[0] if episode.traces else None
        row = dict(cmp, task=episode.task.data.name, reward=trace.reward if trace else None,
                   replies=[m.content for m in trace.assistant_messages] if trace else [],
                   branch=branch_row(trace))
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            same = "token-exact" if cmp["ok"] else f"DIFFERS: {cmp['why']}"
            print(f"{row['task']:>16}  turns={cmp.get('turns')} bridged={cmp.get('bridged')}  "
                  f"reward={row['reward']}  "
                  f"tokens={cmp.get('num_tokens')} sampled={cmp.get('num_sampled')}  {same}  "
                  f"replies={row['replies']}")
    if unclaimed:   # a failed episode's, or a response no trace recorded
        print(f"{unclaimed} of the server's responses are in no episode's trace",
              file=sys.stderr)
    sys.exit(0 if results and not unclaimed and all(c["ok"] for _, c in results) else 1)


if __name__ == "__main__":
    main()
