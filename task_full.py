"""
Mini-countdown over its whole problem space: every multiset of three or four digits
and every target in 1..99 they reach, split by multiset as in task.py. task.py's main
job keeps only the four-digit problems that one blind attempt solves at least 1 time
in 20 (their reach); this is the whole space, those included, most of it beyond a small
model's reach (docs/results.md, by reach band).

    python train_grpo.py config/qwen_small.py --task=task_full   # any stage

Everything but the problems is task.py's: the prompt, the reward, the corpus, the
demonstrations (already over the full space) and both no-learning rules.
"""

import task

prompt_messages, reward, solutions = task.prompt_messages, task.reward, task.solutions
pretrain_corpus, sft_examples = task.pretrain_corpus, task.sft_examples
describe, kind = task.describe, task.kind
heuristic_answer, chain_rule_answer = task.heuristic_answer, task.chain_rule_answer


def make_problems(split, n=None):
    """The first n problems (all if None) of the full space's split, in task.py's order."""
    return task.make_problems(split, n, full=True)
