r"""
TRL's GRPOTrainer on the embedded task (countdown.py), for bench/bench.py's GRPO row: it
runs in TRL's own virtualenv (bench/peers/install.sh) and prints one line "RESULT {json}".

    .peers/trl/bin/python bench/peers/trl_grpo.py MODEL_DIR --steps 20 --prompts 16 --group 8 \
        --max_new_tokens 48 --temperature 1.0 --learning_rate 1e-5 --seed 0

Settings are matched to what bench/bench_peers.py gives train_grpo.py: prompts x group
completions per step in one generation (generate() of transformers, TRL's default
without vLLM), one optimizer step per generation (num_iterations=1), the constant
normalizer prompts x group x max_new_tokens (loss_type='dr_grpo', Dr. GRPO), advantages
divided by the group's std (scale_rewards='group', as our scale_rewards=True), no KL
(beta=0), AdamW with our betas (0.9, 0.95), a constant learning rate, the whole
vocabulary (top_k=0, top_p=1), fp32 on the CPU, no router aux loss (TRL's model does not
add it; ours is told aux_loss_coef=0). The reward is countdown.reward on the decoded
completion, 0 for one cut off by max_new_tokens (ours scores a truncated reply 0 too).
What stays different, by design of each trainer: TRL draws problems uniformly, ours by
p(1 - p); ours drops groups whose rewards are all equal before training (no gradient
either way), TRL trains on them; TRL's std is the unbiased one (+ 1e-4), ours the
population one (+ 1e-6).

Printed: {"step_s": [...], "rollout_s": [...], "reward": [...]} per step; the rollout is
TRL's _generate_and_score_completions (sampling, the reward, advantages), the rest of a
step is training.
"""
import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def grpo_config(args, out_dir):
    from trl import GRPOConfig
    return GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, seed=args.seed, use_cpu=True, bf16=False,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, num_iterations=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_k=0, top_p=1.0, beta=0.0, loss_type="dr_grpo",
        scale_rewards="group", learning_rate=args.learning_rate, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0)


def main():
    args = parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from tasks import countdown

    torch.set_num_threads(args.threads)
    problems = countdown.make_problems("train")
    data = Dataset.from_list([{"prompt": countdown.prompt_messages(p), "index": i}
                              for i, p in enumerate(problems)])
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)

    def countdown_reward(completions, completion_ids, index, **kwargs):
        # a conversational completion is [{"role": "assistant", "content": text}]
        return [0.0 if len(ids) >= args.max_new_tokens and ids[-1] != tokenizer.eos_token_id
                else countdown.reward(problems[i], c[0]["content"])
                for c, ids, i in zip(completions, completion_ids, index)]

    times = {"step_s": [], "rollout_s": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times["step_s"].append(time.perf_counter() - self.t0)

    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model=args.model_dir, reward_funcs=countdown_reward,
                              args=grpo_config(args, out), train_dataset=data,
                              processing_class=tokenizer, callbacks=[Clock()])
        generate = trainer._generate_and_score_completions

        def timed_generate(inputs):
            t0 = time.perf_counter()
            out = generate(inputs)
            times["rollout_s"].append(time.perf_counter() - t0)
            return out
        trainer._generate_and_score_completions = timed_generate
        trainer.train()
        times["reward"] = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    print("RESULT", json.dumps(times), flush=True)


if __name__ == "__main__":
    main()
