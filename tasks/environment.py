"""
Tasks and environments: what a trainer needs from a task, and the episodes it runs
with the engine.

A task is a Python file with the functions below; every stage and tasks/evaluate.py take
it as a setting:

    python train_grpo.py config/qwen_small.py --task=tasks/jsonl.py   # a module or a .py path
    python train_grpo.py config/countdown_feedback.py   # countdown with feedback, max_turns=3, ...

    task = load_task("tasks/jsonl.py")
    env = Environment(task, tokenizer, max_new_tokens=16, max_turns=1)
    episodes = env.episodes(engine, task.make_problems("train", 64), num_samples=8, temperature=1.0)
    episodes[0].reward, episodes[0].sample()    # the score; the episode as one TrainingSample

The contract (tasks/countdown.py, the embedded countdown, implements all of it;
tasks/jsonl.py is a user's single-turn task over a JSONL file,
tasks/countdown_feedback.py a multi-turn one):

    make_problems(split, n=None) -> list       the problems of 'train', 'val' or 'test', in a
                                               fixed order (the first n of them); any objects;
                                               optionally 'confirm', a confirmatory split no
                                               run tunes on (countdown's: five digits)
    prompt_messages(problem) -> list[dict]     the chat that opens an episode ({role, content})
    reward(problem, completion_text) -> float  the score of a single reply (its decoded text
                                               without the closing end-of-turn), in [0, 1]: 1 is
                                               solved (pass@k, success by turn, the sampler's
                                               record and RFT count those)
  multi-turn, optional (a task without them has one-reply episodes):
    env_response(problem, messages) -> list[dict] | None
                                               what the environment says after the conversation
                                               so far (its last message is the model's reply),
                                               or None: the episode is over
    episode_reward(problem, messages) -> float the score of a whole episode, in [0, 1] (without
                                               it: the reward of the last reply)
  env_response and episode_reward get a copy of the conversation; they must be functions of it
  (under torchrun every rank runs them and must agree). A multi-turn run sets max_turns > 1 and
  max_episode_tokens.
  optional extras, for the stages around GRPO:
    pretrain_corpus(n_docs, seed) -> list[str] pretrain.py's documents
    sft_examples(seed, fraction) -> list[list[dict]]   sft.py's demonstrations (conversations)
    solutions(problem) -> list[str]            right answers, best first (sft.py's eval loss)
    describe(problem) -> dict                  the problem's fields in outcomes.jsonl
    kind(problem) -> str                       a group for eval/accuracy_<kind> ('3digits')
    heuristic_answer(problem) -> str           a no-learning baseline (tasks/evaluate.py heuristic);
                                               any RULE_answer is one (tasks/evaluate.py RULE)

An episode is one token sequence built by ids, never by re-rendering text: the prompt's
chat-template ids, the sampled reply exactly as sampled, the template's ids that close
the turn and open the next (the environment's message and the assistant header), the
next reply, and so on. The rule: the training sequence is the sampling sequence. The
history is never rendered again, so a template that renders earlier turns differently
(Qwen3's drops their think blocks) changes nothing: each next turn is the template's
rendering of only the new messages, appended (tokenizer.TurnBridge). Only sampled ids
carry loss weight (mask 1); the environment's and the template's carry 0. A reply's text
is split into reasoning and content where the template thinks (tokenizer.reply_parts):
the reward and env_response see the content. It ends:
  - when a reply did not stop by itself (cut at max_new_tokens): it scores 0, as
    a single reply;
  - when the environment answers None, or max_turns replies were given: the task
    scores it (episode_reward);
  - when the next turn would not fit in max_episode_tokens (every id after the first
    prompt, with room for a whole max_new_tokens reply): the environment's message is
    dropped and the task scores the episode so far.
A function of the task that raises, or returns what the contract does not allow (a
reward that is not a finite number, messages that are not a list of {role, content}),
fails the rollout with a RuntimeError naming the function, the problem and the turn;
nothing of the trainer's state has changed by then.
"""

import dataclasses
import importlib
import importlib.util
import math
import os
import sys

from scaleout import distributed
from engine import SamplingParams, TrainingSample
from inference.sampling import mix_seed
from tokenizer import (TurnBridge, chat_prompt_ids_batch, completion_text, generation_stop_ids,
                       reply_parts)

REQUIRED = ("make_problems", "prompt_messages", "reward")


def load_task(spec):
    """The task module named by spec: a module name ('tasks.countdown', 'tasks.guess')
    or a path to a .py file. Refused with a ValueError naming what is missing."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task={spec!r}: expected a module name or a path to a .py file")
    if spec.endswith(".py") and not os.path.isfile(spec):
        raise ValueError(f"task={spec!r}: no such file")
    try:
        module = import_file(spec) if spec.endswith(".py") else importlib.import_module(spec)
    except Exception as e:   # (a task that imports something missing raises while loading)
        if isinstance(e, ModuleNotFoundError) and e.name == spec:
            raise ValueError(f"task={spec!r}: no module of that name") from e
        raise ValueError(f"task={spec!r} raised while loading: {type(e).__name__}: {e}") from e
    missing = [f for f in REQUIRED if not callable(getattr(module, f, None))]
    if missing:
        raise ValueError(f"task={spec!r} ({module.__file__}) lacks {', '.join(missing)}")
    return module


def import_file(path):
    """The module of a .py file, importable as its own modules are: its folder joins
    sys.path and the module is registered (dataclasses and pickling look it up there)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = "task_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def offers(task, name):
    """Whether the task defines the optional function name."""
    return callable(getattr(task, name, None))


def solved(reward):
    """A reward of 1 (the most a task gives) is a solved problem."""
    return reward >= 1.0


def call(task, name, problem, turn, *args):
    """task.name(problem, *args), checked against the contract: a raise, or a value the
    contract does not allow, becomes a RuntimeError naming the function, the problem
    and the turn."""
    try:
        out = getattr(task, name)(problem, *args)
        if name in ("reward", "episode_reward"):
            if isinstance(out, bool) or not isinstance(out, (int, float)) or not math.isfinite(out):
                raise ValueError(f"returned {out!r}: a reward is a finite number in [0, 1]")
            return float(out)
        if name == "prompt_messages" or name == "env_response" and out is not None:
            if not (isinstance(out, list) and out and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and
                    isinstance(m.get("content"), str) for m in out)):
                none = " or None" if turn else ""
                raise ValueError(f"returned {out!r}, not a list of role/content dicts{none}")
        return out
    except Exception as e:
        raise RuntimeError(f"the task's {name} raised on problem {problem!r} at turn {turn}: "
                           f"{type(e).__name__}: {e}") from e


def generate_sharded(engine, prompts, params, num_samples=1):
    """engine.generate over the prompts, each rank (torchrun) sampling its contiguous
    slice, gathered in order: the same samples as one process sampling them all (a
    seeded draw depends on the prompt's index)."""
    lo, hi = distributed.span(len(prompts))
    return distributed.gather(engine.generate(prompts[lo:hi], params, num_samples, first_index=lo))


# -----------------------------------------------------------------------------
# one episode: the ids so far, and which of them were sampled


@dataclasses.dataclass
class Episode:
    problem: object
    messages: list            # the conversation: the prompt's, each reply, the environment's
    prompt: list              # the first prompt's ids
    ids: list = dataclasses.field(default_factory=list)        # everything after the prompt
    mask: list = dataclasses.field(default_factory=list)       # 1 on sampled ids, 0 on the others
    logprobs: list = dataclasses.field(default_factory=list)   # the engine's, 0.0 where mask is 0
    versions: list = dataclasses.field(default_factory=list)   # weight version per id (see sample)
    turns: int = 0            # replies sampled
    finish_reason: str = "length"   # of the last reply
    reward: float = 0.0
    done: bool = False
    routes: object = None     # the last reply's TrainingSample.routes (cover every id before)

    def sample(self) -> TrainingSample:
        """The episode as one TrainingSample: completion = every id after the first
        prompt, loss_mask marks the sampled ones. An environment id carries the version
        of the reply before it, so weight_version is the oldest weights that sampled any
        of its ids."""
        return TrainingSample(
            prompt_tokens=tuple(self.prompt), completion_tokens=tuple(self.ids),
            logprobs=tuple(self.logprobs), weight_version=min(self.versions, default=0),
            finish_reason=self.finish_reason, token_versions=tuple(self.versions),
            loss_mask=tuple(self.mask), routes=self.routes)

    def replies(self):
        return [m["content"] for m in self.messages if m["role"] == "assistant"]


@dataclasses.dataclass(frozen=True)
class Group:
    """One problem's episodes as the trainer takes them: group_size samples of one
    prompt and the task's reward for each (train_grpo.build_batches packs them)."""
    problem: object   # what was drawn; None where only the ids travelled (a rollout rank)
    samples: list     # [TrainingSample], one prompt
    rewards: list     # [float], one per sample

    @property
    def prompt(self) -> tuple:
        return self.samples[0].prompt_tokens


class Environment:
    """A task with the bounds of its episodes and the tokenizer that renders them: what
    the trainers and the evaluation run episodes with."""

    def __init__(self, task, tokenizer, max_new_tokens, max_turns=1, max_episode_tokens=0,
                 stop_ids=None, template_kwargs=None):
        if max_turns > 1 and not offers(task, "env_response"):
            raise ValueError(f"max_turns={max_turns}: the task {task.__name__!r} has no "
                             f"env_response, so its episodes are one reply; use max_turns=1")
        if max_turns > 1 and max_episode_tokens <= max_new_tokens:
            raise ValueError(f"max_episode_tokens={max_episode_tokens}: a multi-turn episode needs "
                             f"more than max_new_tokens={max_new_tokens} (max_turns={max_turns})")
        self.task, self.tokenizer = task, tokenizer
        self.max_new_tokens, self.max_turns = max_new_tokens, max_turns
        # single-turn: an episode is one reply
        self.max_episode_tokens = max_episode_tokens if max_turns > 1 else max_new_tokens
        # what ends a reply: the checkpoint's stop ids (checkpoint.stop_ids_of), else the
        # tokenizer's; template_kwargs go to every rendering (Qwen3's enable_thinking, ...)
        self.stop = frozenset(generation_stop_ids(tokenizer) if stop_ids is None else stop_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self._bridge = None  # the template's ids between turns, made once

    def prompts(self, problems):
        """Each problem's opening messages and their chat-template ids, made once: these
        exact ids go to the engine and into the training batch."""
        messages = [call(self.task, "prompt_messages", p, 0) for p in problems]
        return messages, chat_prompt_ids_batch(self.tokenizer, messages, **self.template_kwargs)

    def max_len(self, problems):
        """The longest sequence an episode over these problems can reach: prompt + budget."""
        return max(map(len, self.prompts(problems)[1])) + self.max_episode_tokens

    def episodes(self, engine, problems, num_samples=1, temperature=0.0, seed=None, top_p=1.0,
                 top_k=0):
        """num_samples episodes per problem (consecutive), run to their end. Turn 1
        samples each prompt num_samples times (one prefill, shared blocks); each later
        turn continues the episodes still going, by ids, from the engine's prefix cache.
        Seeded: turn t's draws are a function of (seed, t, the episode's place among
        those still going). top_p / top_k truncate what is drawn (the logprobs are then
        the truncated distribution's)."""
        messages, prompts = self.prompts(problems)
        episodes = [Episode(p, list(messages[i]), prompts[i])
                    for i, p in enumerate(problems) for _ in range(num_samples)]
        params = SamplingParams(temperature=temperature, max_tokens=self.max_new_tokens,
                                stop_token_ids=self.stop, seed=seed, top_p=top_p, top_k=top_k)
        samples = generate_sharded(engine, prompts, params, num_samples)
        going, turn = episodes, 1
        while going:
            for e, s in zip(going, samples):
                self.take_reply(e, s, turn)
            going, turn = [e for e in going if not e.done], turn + 1
            if going:
                seeded = params if seed is None else \
                    dataclasses.replace(params, seed=mix_seed(seed, turn))
                prompts = [e.prompt + e.ids for e in going]
                samples = generate_sharded(engine, prompts, seeded)
        return episodes

    def take_reply(self, e, s, turn):
        """Add reply s to episode e, then end the episode or add the environment's answer."""
        n = len(s.completion_tokens)
        e.ids += s.completion_tokens
        e.mask += [1] * n
        e.logprobs += s.logprobs
        e.versions += s.token_versions
        e.turns, e.finish_reason, e.routes = turn, s.finish_reason, s.routes
        if s.finish_reason != "stop":
            e.done, e.reward = True, 0.0
            return
        reasoning, text = reply_parts(self.tokenizer, self.reply_content(s))
        reply = {"role": "assistant", "content": text}
        e.messages.append(reply if reasoning is None else {**reply, "reasoning_content": reasoning})
        if not offers(self.task, "env_response"):
            e.done, e.reward = True, call(self.task, "reward", e.problem, turn, text)
            return
        new = None if turn >= self.max_turns else call(self.task, "env_response", e.problem, turn,
                                                       list(e.messages))
        try:
            more = None if new is None else self.turn_ids(new, s.completion_tokens[-1])
        except (ValueError, TypeError) as err:
            raise RuntimeError(f"the task's env_response on problem {e.problem!r} at turn {turn}: "
                               f"{err}") from err
        fits = more is not None and \
            len(e.ids) + len(more) + self.max_new_tokens <= self.max_episode_tokens
        if fits:
            e.messages += new
            e.ids += more
            e.mask += [0] * len(more)
            e.logprobs += [0.0] * len(more)
            e.versions += [e.versions[-1]] * len(more)
            return
        e.done = True
        if offers(self.task, "episode_reward"):
            e.reward = call(self.task, "episode_reward", e.problem, turn,
                            list(e.messages))
        else:
            e.reward = call(self.task, "reward", e.problem, turn, text)

    def reply_content(self, s):
        """A finished reply as the reward and the conversation see it: its text
        without the closing stop token (other special tokens kept, so
        '3*<|im_start|>5+7' is not '3*5+7')."""
        return completion_text(self.tokenizer, s.completion_tokens[:-1])

    def turn_ids(self, new_messages, last_id):
        """The template's ids between a reply whose last id is last_id and the next
        reply: the rest of the assistant turn's close, the new messages, the
        assistant header (tokenizer.TurnBridge)."""
        if self._bridge is None:
            self._bridge = TurnBridge(self.tokenizer, self.stop, **self.template_kwargs)
        return self._bridge.next_ids(new_messages, last_id)
