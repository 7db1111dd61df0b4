"""
bench/bench.py's rows against the systems a user would pick instead of ours: vLLM for
rollouts, TRL's GRPOTrainer for the trainer. Each peer runs in a virtualenv of its own
(bash bench/peers/install.sh) and in a process of its own, driven from here; a peer that
is not installed gets a line saying how to install it, never a crash.

    python -m bench.bench                     # every row, the peers' included when installed
    python -m bench.bench --peers only        # only these rows

Rollouts (rollout_vs_vllm): the same random checkpoint, the same prompts (a shared
prefix + a distinct question), n samples each, temperature 1 over the whole vocabulary,
the logprob of each sampled token, the same stop ids and max_tokens; completion tokens
counted the same way (up to and including the stop token); calls interleaved ours, vLLM,
ours, ... so that both see the same background load; each side's time is its generate
call alone. Placements:
  'pinned': ours on core 0 (one torch thread), vLLM's engine in its own process on core 1 (one
            OpenMP thread, its engine core in that process: VLLM_ENABLE_V1_MULTIPROCESSING=0);
  'deployed': vLLM as it starts by default (an engine-core process, its own thread binding), ours
            at one thread; the CPU seconds each side spent per call are printed beside.

GRPO (grpo_vs_trl): train_grpo.py and TRL's GRPOTrainer (bench/peers/trl_grpo.py says
how its settings are matched) from the same SFT checkpoint on the embedded task, one
thread each, one run after the other, repeated; seconds per step (rollout and training)
as the median over steps after the first.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def peer_python(peers_dir, name):
    """the peer's virtualenv python, or None when it is not installed"""
    path = os.path.join(peers_dir, name, "bin", "python")
    return path if os.path.exists(path) else None


def peer_version(python, distribution):
    code = f"import importlib.metadata as m; print(m.version('{distribution}'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def not_installed(name, peers_dir):
    return f"{name} not installed in {peers_dir}: bash bench/peers/install.sh {name} (into .peers/)"


def completion_len(row, stop):
    """tokens up to and including the first stop id"""
    for i, t in enumerate(row):
        if t in stop:
            return i + 1
    return len(row)


# -----------------------------------------------------------------------------
# rollouts: vLLM's offline LLM.generate in its own process


class VllmWorker:
    """bench/peers/vllm_worker.py in vLLM's venv: one LLM on model_dir, generate requests
    over a pipe"""

    def __init__(self, python, model_dir, max_model_len, seed, placement):
        # vLLM's IPC sockets go in a folder of ours, removed at close (it leaves them in
        # /tmp)
        self.sockets = tempfile.mkdtemp(prefix="vllm_ipc_")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               "VLLM_RPC_BASE_PATH": self.sockets}
        cmd = [python, os.path.join(ROOT, "bench", "peers", "vllm_worker.py"), model_dir,
               str(max_model_len), str(seed)]
        if placement == "pinned":
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="1",
                       OMP_NUM_THREADS="1")
            cmd = ["taskset", "-c", "1"] + cmd
        env.update(preloads(python))
        self.log = tempfile.TemporaryFile("w+")   # its stderr, shown if it dies
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, stderr=self.log)
        try:
            self._read()   # {"ready": true}
        except BaseException:
            self.close()
            raise

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        self.log.seek(0)
        tail = self.log.read()[-2000:]
        raise RuntimeError(f"the vLLM worker ended (exit code {self.proc.wait()}):\n{tail}")

    def generate(self, prompts, n, temperature, max_tokens, stop, seed):
        request = dict(prompts=prompts, n=n, temperature=temperature, max_tokens=max_tokens,
                       stop_token_ids=sorted(stop), seed=seed)
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self):
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            # it died, or hangs: never leave it running
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.sockets, ignore_errors=True)


def preloads(python):
    """LD_PRELOAD as vLLM's CPU guide sets it: tcmalloc (when the system has it) and the
    Intel OpenMP that vllm-cpu installs into its venv"""
    venv = os.path.dirname(os.path.dirname(python))
    found = [os.path.join(venv, "lib", "libiomp5.so")]
    found += [os.path.join(d, "libtcmalloc_minimal.so.4")
              for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")]
    found = [p for p in found if os.path.exists(p)]
    return {"LD_PRELOAD": ":".join(found)} if found else {}


def rollout_vs_vllm(python, model_dir, engine, prompts, stop, samples, max_new_tokens, repeats,
                    placement, seed=0):
    """(ours tok/s, vLLM tok/s, ours CPU-s per call, vLLM CPU-s per call) on engine (ours,
    on model_dir's weights) and a vLLM worker on model_dir. Pinned: ours on core 0, vLLM
    on core 1 (bench/bench.py checks that this process may use both)."""
    from engine import SamplingParams
    params = SamplingParams(temperature=1.0, max_tokens=max_new_tokens,
                            stop_token_ids=frozenset(stop))
    max_len = max(map(len, prompts)) + max_new_tokens
    mask = os.sched_getaffinity(0)
    worker = VllmWorker(python, model_dir, max_len, seed, placement)

    def ours():
        # every timed call starts cold, as vLLM's (reset_prefix_cache)
        engine.flush_cache()
        c0, t0 = time.process_time(), time.perf_counter()
        out = engine.generate(prompts, params, num_samples_per_prompt=samples)
        return (time.perf_counter() - t0, time.process_time() - c0,
                sum(len(s.completion_tokens) for s in out))

    def theirs(r):
        out = worker.generate(prompts, samples, 1.0, max_new_tokens, stop, seed + r)
        return out["seconds"], out["cpu_seconds"], sum(completion_len(c, stop)
                                                       for c in out["completions"])
    try:
        if placement == "pinned":
            os.sched_setaffinity(0, {0})
        ours(), theirs(0)   # warm-up: first-call costs on both sides
        runs = [(ours(), theirs(r + 1)) for r in range(repeats)]
    finally:
        os.sched_setaffinity(0, mask)
        worker.close()
    rate = [statistics.median(run[i][2] / run[i][0] for run in runs) for i in (0, 1)]
    cpu = [statistics.median(run[i][1] for run in runs) for i in (0, 1)]
    return rate[0], rate[1], cpu[0], cpu[1]


# -----------------------------------------------------------------------------
# GRPO: train_grpo.py against TRL's GRPOTrainer


def ours_grpo(init_dir, steps, prompts, group, max_new_tokens, temperature, lr, seed):
    """train_grpo.py for steps iterations (adam betas 0.9, 0.95: its defaults, given to
    TRL too); per-step seconds from its metrics.jsonl"""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "train_grpo.py"), "config/qwen_small.py",
               f"--init_from={init_dir}", f"--out_dir={out}", f"--max_iters={steps}",
               f"--prompts_per_step={prompts}", f"--group_size={group}",
               f"--max_new_tokens={max_new_tokens}", f"--temperature={temperature}",
               f"--learning_rate={lr}", f"--min_lr={lr}", "--warmup_iters=0",
               "--scale_rewards=True", "--aux_loss_coef=0.0",   # TRL's model adds no router loss
               "--loss_norm=constant", f"--seed={seed}", "--n_eval_problems=8",
               "--pass_k=0", "--keep_best=False", f"--eval_interval={steps + 1}",
               f"--ckpt_interval={steps + 1}", "--log_interval=1"]
        run(cmd)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "perf/step_time_s" in r]
    return {"step_s": [r["perf/step_time_s"] for r in rows],
            "rollout_s": [r["perf/rollout_time_s"] for r in rows],
            "reward": [r["rollout/reward_mean"] for r in rows]}


def trl_grpo(python, init_dir, steps, prompts, group, max_new_tokens,
             temperature, lr, seed):
    cmd = [python, os.path.join(ROOT, "bench", "peers", "trl_grpo.py"), init_dir,
           f"--steps={steps}",
           f"--prompts={prompts}", f"--group={group}", f"--max_new_tokens={max_new_tokens}",
           f"--temperature={temperature}", f"--learning_rate={lr}", f"--seed={seed}", "--threads=1"]
    out = run(cmd)
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][7:])


def run(cmd, timeout=1800):
    """cmd at one thread; its stdout, or an error that shows the end of its output"""
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return out.stdout


# the GRPO row's settings, for both trainers (bench/bench.py prints them in the row's name)
GRPO = dict(prompts=16, group=8, max_new_tokens=48, temperature=1.0, lr=1e-5)


def grpo_vs_trl(python, init_dir, steps, repeats, prompts, group, max_new_tokens,
                temperature, lr):
    """{'ours': (step s, rollout s, train s, reward), 'trl': ...}: medians over the steps
    after the first of every run (train: step - rollout), the reward of the rollouts of
    the last 5 steps; runs interleaved ours, TRL, ours, ..."""
    runs = {"ours": [], "trl": []}
    for r in range(repeats):
        runs["ours"].append(ours_grpo(init_dir, steps, prompts, group, max_new_tokens,
                                      temperature, lr, seed=r))
        runs["trl"].append(trl_grpo(python, init_dir, steps, prompts, group, max_new_tokens,
                                    temperature, lr, seed=r))
    summary = {}
    for name, rs in runs.items():
        assert all(len(r["step_s"]) == len(r["rollout_s"]) == steps for r in rs), name
        step = statistics.median(s for r in rs for s in r["step_s"][1:])
        rollout = statistics.median(s for r in rs for s in r["rollout_s"][1:])
        train = statistics.median(s - g for r in rs
                                  for s, g in zip(r["step_s"][1:], r["rollout_s"][1:]))
        reward = statistics.mean(statistics.mean(r["reward"][-5:]) for r in rs)
        summary[name] = (step, rollout, train, reward)
    return summary
