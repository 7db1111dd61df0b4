"""Scale-out: the OpenAI-compatible server and its client, rollouts from servers or rollout
ranks (sources.py is train_grpo's seam), weight broadcast, torchrun data parallelism."""
