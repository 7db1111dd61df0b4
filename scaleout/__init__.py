"""Scale-out: the OpenAI-compatible server and its client, rollouts from servers or rollout
ranks (train_grpo_async.py's sources), weight broadcast, torchrun data parallelism."""
