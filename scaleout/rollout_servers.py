"""
Rollouts from running servers, scaleout/serve.py or `vllm serve` with this project's
weight-transfer backend (docs/scale_out.md): train_grpo_async --rollout_urls.

    python -m scaleout.serve --model_path=DIR --port=8000 --enable_weight_updates=True &   # per GPU
    # once GET :8000/health answers (it compiles its decode step first)
    python train_grpo_async.py config/qwen_small.py --rollout_urls=http://127.0.0.1:8000

The trainer samples through HTTP exactly as it samples in-process: RemoteEngine has the
engine's generate(prompts, params, num_samples, first_index), so tasks/environment.py's
episodes (multi-turn ones too) run unchanged. A rollout's prompts are split across the
servers in contiguous shares, sent as token ids to /v1/completions with the rollout's seed
and each share's first_index, so each prompt draws what it would draw in one in-process
engine.generate call: with the same weights, a run through our servers samples what the
colocated run samples (vLLM's rollouts go unseeded: RemoteEngine.sample). After each
optimizer step the trainer pushes its weights to every server over a process group of
their own (weight_sync.ServerWeights); the first push, at start, makes the servers serve
the trainer's starting weights whatever they loaded.

Bounded staleness as scaleout/rollout_ranks.py defines it (Servers): with
max_staleness=0 rollout j is sampled with the weights after iteration j - 1, the
colocated run's samples; with 1 the servers sample the next rollout while the trainer
trains (tis_cap corrects it). A server that is down or answers an error fails the step
naming its URL; the run's last checkpoint is untouched, and --init_from=resume
continues once the server is back.
"""

import dataclasses
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import lora
from scaleout.client import sample_from_response
from scaleout.weight_sync import ServerWeights


class RemoteEngine:
    """InferenceEngine.generate over HTTP, split across servers; model_config is the
    served model's (for FLOP counts)."""

    def __init__(self, urls, model_config, api_key="", timeout_s=600):
        self.urls, self.timeout_s = list(urls), timeout_s
        self.model = dataclasses.make_dataclass("Served", ["config"])(model_config)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.version = 0
        self.owners = {}   # url -> who serves it: /v1/models' owned_by ('nano-rl' is ours)

    def get_weight_version(self):
        return self.version

    def generate(self, prompts, sampling_params, num_samples_per_prompt=1, first_index=0):
        """The samples of every prompt, in request order (prompt 0 samples 0..n-1,
        prompt 1 ...), each server sampling a contiguous share."""
        return self.fan_out(len(prompts), lambda url, lo, hi: self.sample(
            url, prompts[lo:hi], sampling_params, num_samples_per_prompt, first_index + lo))

    def fan_out(self, n, work):
        """work(url, lo, hi) on every server at once, each taking a contiguous share of n
        items (e.g. 5 on 2 servers -> 0-1 and 2-4; a server with none is skipped); the
        lists they return, concatenated in server order."""
        k = len(self.urls)
        shares = [(url, i * n // k, (i + 1) * n // k) for i, url in enumerate(self.urls)]
        with ThreadPoolExecutor(k) as pool:
            parts = pool.map(lambda share: work(*share), [s for s in shares if s[2] > s[1]])
            return [x for part in parts for x in part]

    def sample(self, url, prompts, params, n, first_index):
        """One server's share. Ours draws prompt i of a seeded request from (seed,
        first_index + i), so the servers sample what the colocated run samples. vLLM's
        seeds do not serve: it draws every prompt of a request from the one seed (on a
        near-flat distribution the prompts' samples come out the same), and on the CPU a
        seeded request can kill its engine (vLLM 0.32.0 rewinds the request's generator
        when it drops a partial prefill's token, which a CPU generator cannot). So to
        vLLM a rollout goes unseeded: every draw independent, and a resumed run does not
        redraw the killed run's samples."""
        if self.owner(url) != "nano-rl":
            params = dataclasses.replace(params, seed=None)
        return self.request(url, prompts, params, n, first_index)

    def owner(self, url):
        if url not in self.owners:
            r = httpx.get(url + "/v1/models", headers=self.headers, timeout=self.timeout_s)
            if r.status_code != 200:
                raise RuntimeError(f"rollout server {url}: /v1/models answered {r.status_code}")
            self.owners[url] = r.json()["data"][0].get("owned_by")
        return self.owners[url]

    def request(self, url, prompts, params, n, first_index):
        """/v1/completions with token-id prompts, the stop ids exactly the params'
        (ignore_eos: the server adds none of its own)."""
        body = {"prompt": [list(p) for p in prompts], "n": n, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "seed": params.seed, "first_index": first_index,
                "logprobs": 0, "return_token_ids": True, "ignore_eos": True,
                "stop_token_ids": sorted(params.stop_token_ids)}
        try:
            r = httpx.post(url + "/v1/completions", json=body, headers=self.headers,
                           timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeError(f"rollout server {url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise RuntimeError(f"rollout server {url} answered {r.status_code}: {r.text[:300]}")
        response = r.json()
        samples = []
        for i in range(len(response["choices"])):
            s = sample_from_response(response, i)
            # the trainer's count of versions (a server counts its own, from its start)
            versions = (self.version,) * len(s.completion_tokens)
            samples.append(dataclasses.replace(s, sample_index=i % n, weight_version=self.version,
                                               token_versions=versions))
        return samples


def wait_until_up(urls, timeout_s=600):
    """Return once every server answers GET /health (a server compiles or loads for a
    minute or so after it starts); RuntimeError naming the first that does not within
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                if httpx.get(url + "/health", timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"rollout server {url}: no answer to GET /health within "
                                   f"{timeout_s} s; is it started, on that host and port?")
            time.sleep(2)


class Servers:
    """train_grpo_async's rollout source when scaleout/serve.py processes sample (the
    interface of train_grpo_async.Colocated). One thread of this process drives the servers, rollout
    after rollout, with scaleout/rollout_ranks.py's schedule: rollout j is sampled with
    the weights after iteration j - s (s = max_staleness; the starting weights while j -
    s is before the start), so with s >= 1 the servers sample rollout j + 1 while the
    trainer trains on rollout j. publish() hands each new version to that thread, which
    pushes it to every server between two rollouts, never inside one. The trainer's own
    engine only evaluates."""

    def __init__(self, config, env, sampler, model, engine, version, rollout, start_iter):
        urls = [u.strip().rstrip("/") for u in config["rollout_urls"].split(",") if u.strip()]
        wait_until_up(urls)
        self.config, self.env, self.sampler, self.rollout = config, env, sampler, rollout
        self.engine, self.version, self._evaluated = engine, version, version
        self.remote = RemoteEngine(urls, model.config, config["rollout_api_key"])
        # the servers take whole weights (a LoRA model's merged)
        weights = dict(lora.merged_items(model))
        self.push = ServerWeights(urls, weights, config["weight_bucket_mb"],
                                  config["weight_backend"], config["weight_master_address"],
                                  config["rollout_api_key"])
        # the servers serve the trainer's starting weights, labelled by the trainer's version
        self.push.send(weights, str(version))
        self.remote.version = version
        self.weights, self.rollouts = queue.Queue(), queue.Queue()
        # the sampler's record after the last rollout taken
        self.state = sampler.state_dict()
        threading.Thread(target=self.drive, args=(start_iter,), daemon=True).start()

    def drive(self, start_iter):
        """The servers' side of the schedule, on its own thread: push the weights
        rollout j is due, sample it, hand it over (with the sampler's record after it,
        what a checkpoint saves)."""
        try:
            weights_of = start_iter  # the servers hold the weights after this iteration
            for j in range(start_iter, self.config["max_iters"]):
                pushed = 0.0
                while weights_of < j - self.config["max_staleness"]:
                    t0 = time.perf_counter()
                    self.push.send(self.weights.get(), str(self.remote.version + 1))
                    weights_of, self.remote.version = weights_of + 1, self.remote.version + 1
                    pushed += time.perf_counter() - t0
                groups, flops, metrics = self.rollout(self.remote, self.env, self.sampler,
                                                      self.config, j)
                metrics["perf/weight_sync_s"] = pushed
                self.rollouts.put((groups, flops, metrics, self.sampler.state_dict()))
        except Exception as e:                      # the trainer raises it in groups()
            self.rollouts.put(e)

    def groups(self, it):
        """Rollout it, waiting for it if the servers are still on it."""
        t0 = time.perf_counter()
        out = self.rollouts.get()
        if isinstance(out, Exception):
            raise out
        groups, flops, metrics, self.state = out
        lags = [self.version - v for g in groups for s in g.samples
                for v in s.token_versions] or [0]
        metrics.update({"rollout/staleness_max": max(lags), "perf/rollout_wait_s":
                        time.perf_counter() - t0})
        return groups, flops, metrics

    def data_state(self):
        return self.state

    def publish(self, model, it):
        """After iteration it: a copy of the new weights for the servers, if a later
        rollout is due them."""
        self.version += 1
        if it + 1 + self.config["max_staleness"] < self.config["max_iters"]:
            self.weights.put({k: v.detach().clone() for k, v in lora.merged_items(model)})
        return {}

    def eval_engine(self, model):
        """The trainer's own engine (for evaluation only), brought up to the trainer's
        weights."""
        if self._evaluated != self.version:
            self.engine.update_from(model)
            self._evaluated = self.version
        return self.engine
