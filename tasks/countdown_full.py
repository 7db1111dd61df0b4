"""
Mini-countdown over its whole problem space: every multiset of three or four digits and
every target in 1..99 they reach, split by multiset as in countdown.py. countdown.py's
main job keeps only the four-digit problems that one blind attempt solves at least 1
time in 20 (their reach); this is the whole space, those included, most of it beyond a
small model's reach (docs/results.md, by reach band).

    python train_grpo.py config/qwen_small.py --task=tasks.countdown_full   # any stage

Everything but the problems is countdown.py's: the prompt, the reward, the corpus, the
demonstrations (already over the full space) and both no-learning rules.
"""

from tasks import countdown

prompt_messages, reward = countdown.prompt_messages, countdown.reward
solutions = countdown.solutions
pretrain_corpus, sft_examples = countdown.pretrain_corpus, countdown.sft_examples
describe, kind = countdown.describe, countdown.kind
heuristic_answer, chain_rule_answer = countdown.heuristic_answer, countdown.chain_rule_answer


def make_problems(split, n=None):
    """The first n problems (all if None) of the full space's split, in countdown.py's
    order."""
    return countdown.make_problems(split, n, full=True)
