"""
The three worked forks of docs/forks.md, applied to train_grpo.py as the document writes them
and run: each section's diff blocks (context lines ' ', removed '-', added '+') must match the
file exactly once, and the forked file must run three GRPO iterations.

    python -m bench.forks_check                       # apply each fork, compile it, nothing run
    python -m bench.forks_check --run --init_from=out/compare/seed1/sft/best --n_eval_problems=100 \
        --keep=docs/results/forks          # each fork's metrics.jsonl kept there

--run copies the root's entries into a temporary folder by symlink, with the forked
train_grpo.py in place of the real one, and runs
`train_grpo.py config/qwen_small.py --max_iters=3` there (an out_dir of its own per fork), then
prints each fork's reward at iteration 3 and its validation accuracy at 0 and 3. Any other
--key=value goes to train_grpo.py; --keep=DIR keeps each fork's metrics.jsonl in DIR.
tests/test_style.py checks that the diffs apply.
"""
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "forks.md")


def diff_blocks(text):
    """Per '## ' section of the document that has diff blocks: (title, [(old, new)])."""
    forks = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        title = section.splitlines()[0]
        blocks = re.findall(r"```diff\n(.*?)```", section, flags=re.S)
        if blocks:
            forks.append((title, [old_and_new(b) for b in blocks]))
    return forks


def old_and_new(block):
    """A diff block's lines as the text it replaces and the text it puts in their place."""
    old, new = [], []
    for line in block.splitlines():
        mark, rest = line[:1], line[1:]
        if mark in (" ", "-"):
            old.append(rest)
        if mark in (" ", "+"):
            new.append(rest)
    return "\n".join(old) + "\n", "\n".join(new) + "\n"


def forked_sources(doc=DOC, source=os.path.join(ROOT, "train_grpo.py")):
    """{title: train_grpo.py with that section's diffs applied}. A diff whose old text is
    not in the file exactly once raises ValueError naming the section."""
    with open(doc) as f:
        forks = diff_blocks(f.read())
    with open(source) as f:
        original = f.read()
    out = {}
    for title, blocks in forks:
        text = original
        for old, new in blocks:
            if text.count(old) != 1:
                raise ValueError(f"docs/forks.md, {title!r}: a diff's old lines occur "
                                 f"{text.count(old)} times in train_grpo.py, not once:\n{old}")
            text = text.replace(old, new)
        out[title] = text
    return out


def run_fork(text, args):
    """train_grpo.py forked as text, three iterations from a folder of links to the root;
    returns its metrics.jsonl rows."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(ROOT):
            if name != "train_grpo.py":
                os.symlink(os.path.join(ROOT, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "train_grpo.py"), "w") as f:
            f.write(text)
        out = os.path.join(tmp, "fork_out")
        cmd = [sys.executable, "train_grpo.py", "config/qwen_small.py", "--max_iters=3",
               "--eval_interval=3", "--ckpt_interval=3", "--keep_best=False",
               f"--out_dir={out}", *args]
        subprocess.run(cmd, cwd=tmp, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def summary(rows):
    """(reward at iteration 3, validation accuracy at 0 and at 3) of a fork's run."""
    reward = [r["rollout/reward_mean"] for r in rows if r.get("iter") == 3 and
              "rollout/reward_mean" in r]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    return reward[0], accuracy[0], accuracy[-1]


def main(argv):
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return
    sources = forked_sources()
    for title, text in sources.items():
        compile(text, f"train_grpo.py ({title})", "exec")
        print(f"applies and compiles: {title}")
    if "--run" not in argv:
        return
    keep = next((a.split("=", 1)[1] for a in argv if a.startswith("--keep=")), None)
    args = [a for a in argv if a != "--run" and not a.startswith("--keep=")]
    for i, (title, text) in enumerate(sources.items(), 1):
        rows = run_fork(text, args)
        if keep:   # the fork's metrics, whole, behind the printed line
            os.makedirs(keep, exist_ok=True)
            with open(os.path.join(keep, f"fork{i}_metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(dict(r, fork=title)) + "\n" for r in rows)
        reward, start, end = summary(rows)
        print(f"{title}: reward at iteration 3 {reward:.3f}, validation {start:.3f} -> {end:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
