"""
Countdown with feedback, a multi-turn environment: the model answers, the environment
says what the answer came to, and the model may try again, up to max_turns answers
(train_grpo's setting). The episode scores 1 if any answer is right; it ends at the
first right one.

    # from the speedrun's pretrained model (out/qwen_small/pretrain): SFT, then GRPO
    python sft.py config/countdown_feedback.py && python train_grpo.py config/countdown_feedback.py

    user:      digits 3 5 7 target 22
    assistant: 22+3=25[57] 25=5*7
    user:      5 and 7 make 2, 12, 35, not 25
               digits 3 5 7 target 22
    assistant: 22-7=15[35] 15=3+5
    user:      3 and 5 do make 15, but not as the last word says
               digits 3 5 7 target 22
    assistant: 22-7=15[35] 15=3*5         (right: the episode ends, reward 1)

A chain gets its first fault named (countdown.chain_fault, what the reward checks); an
expression gets its value.

The problems are the full countdown space's (countdown_full.py: its results were measured
there), the prompt and per-answer reward the embedded countdown's (countdown.py), so a
model fine-tuned on it starts here; what it has to learn is to use the feedback.
"""

import random

from tasks import countdown
from tasks import countdown_full

# the full countdown space's problems; the embedded countdown's prompt,
# per-answer reward, extras
make_problems = countdown_full.make_problems
prompt_messages, reward = countdown.prompt_messages, countdown.reward
pretrain_corpus, solutions = countdown.pretrain_corpus, countdown.solutions
describe, kind, heuristic_answer = countdown.describe, countdown.kind, countdown.heuristic_answer


def feedback(problem, reply):
    """What the environment says about a wrong reply: its value (or why it has none)."""
    line = countdown.final_line(reply)  # the reward reads the last line too
    if "=" in line:                     # a chain of steps: its first fault (countdown.py)
        return countdown.chain_fault(problem, line)
    parsed = countdown.parse_answer(line)
    if parsed is None:
        return "not an expression"
    value, used = parsed
    if sorted(used) != sorted(problem.digits):
        return f"uses digits {' '.join(map(str, sorted(used)))}"
    return f"= {value}, target {problem.target}"


def env_response(problem, messages):
    """None after a right answer (the episode is over), else the feedback on the last one
    and the problem again (a model tuned on one-turn episodes answers what follows
    'digits ... target')."""
    reply = messages[-1]["content"]
    if reward(problem, reply) == 1.0:
        return None
    again = prompt_messages(problem)[0]["content"]
    return [{"role": "user", "content": f"{feedback(problem, reply)}\n{again}"}]


def episode_reward(problem, messages):
    """1.0 if any answer of the episode is right."""
    return max(reward(problem, m["content"]) for m in messages if m["role"] == "assistant")


def sft_examples(seed, fraction=countdown.SFT_FRACTION):
    """countdown's demonstrations, a third of them after one wrong answer and its feedback
    and a third after two: blind attempts that missed, so SFT shows what a later turn
    looks like. sft.py learns the last reply only; the wrong ones are context."""
    rng, out = random.Random(seed), []
    for problem, line in countdown.demonstrations(seed, fraction):
        messages = prompt_messages(problem)
        for _ in range(rng.randrange(3)):
            wrong = _miss(rng, problem)
            if wrong is None:
                break
            messages = messages + [{"role": "assistant", "content": wrong}]
            messages = messages + env_response(problem, messages)
        out.append(messages + [{"role": "assistant", "content": line}])
    return out


def _miss(rng, problem, tries=100):
    """A blind attempt (countdown.py) that misses, or None if none of tries does."""
    for _ in range(tries):
        line, solved = countdown._attempt(rng, problem.target, problem.digits)
        if not solved:
            return line
    return None
