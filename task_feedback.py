"""
Countdown with feedback, a multi-turn environment: the model answers, the environment says what the
answer came to, and the model may try again, up to max_turns answers (train_grpo's setting). The
episode scores 1 if any answer is right; it ends at the first right one.

    python train_grpo.py config/countdown_feedback.py

    user:      digits 3 5 7 target 23
    assistant: 3*5+7
    user:      = 22, target 23
    assistant: 3*7+5
    user:      = 26, target 23
    assistant: 3+5*7                      (wrong: 38; the episode ends at max_turns=3, reward 0)

The problems, splits, prompt and per-answer reward are the embedded countdown's (task.py), so a
model fine-tuned on it starts here; what it has to learn is to use the feedback.
"""

import task

# the embedded countdown's problems, prompt, per-answer reward and extras
make_problems, prompt_messages, reward = task.make_problems, task.prompt_messages, task.reward
pretrain_corpus, sft_examples, solutions = task.pretrain_corpus, task.sft_examples, task.solutions
describe, kind, heuristic_answer = task.describe, task.kind, task.heuristic_answer


def feedback(problem, reply):
    """What the environment says about a wrong reply: its value (or why it has none)."""
    line = task.final_line(reply)   # the reward reads the last line too
    if "=" in line:   # a chain of steps (task.py): right or wrong, no value
        return "not a right chain"
    parsed = task.parse_answer(line)
    if parsed is None:
        return "not an expression"
    value, used = parsed
    if sorted(used) != sorted(problem.digits):
        return f"uses digits {' '.join(map(str, sorted(used)))}"
    return f"= {value}, target {problem.target}"


def env_response(problem, messages):
    """None after a right answer (the episode is over), else the feedback on the last one."""
    reply = messages[-1]["content"]
    if reward(problem, reply) == 1.0:
        return None
    return [{"role": "user", "content": feedback(problem, reply)}]


def episode_reward(problem, messages):
    """1.0 if any answer of the episode is right."""
    return max(reward(problem, m["content"]) for m in messages if m["role"] == "assistant")
