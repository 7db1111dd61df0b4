"""
vLLM's offline engine, driven by bench/bench.py over a pipe: it runs in vLLM's own
virtualenv (bench/peers/install.sh), so its pinned dependencies never meet ours.

    .peers/vllm/bin/python bench/peers/vllm_worker.py MODEL_DIR MAX_MODEL_LEN SEED

It builds one vllm.LLM on MODEL_DIR (a transformers checkpoint without a tokenizer:
prompts go in as token ids), says "RESULT {"ready": true}" on stdout, then answers one
JSON request per stdin line:
    {"prompts": [[ids]], "n": 8, "temperature": 1.0, "max_tokens": 100, "stop_token_ids": [0, 1],
     "seed": 3}
with "RESULT " + {"seconds": the generate call alone, "cpu_seconds": of this process and
its children during it, "completions": [[ids] per sample], "logprobs": [[...]]} (vLLM
logs to stdout too: the prefix tells our lines apart). An empty line or EOF ends it.
Settings match what bench/bench.py gives our engine: prefix caching on with a block size
that lets the shared prefix hit (32, the smallest its CPU attention takes), the logprob
of each sampled token after temperature (logprobs_mode='processed_logprobs', what our
engine reports), fp32, the model's EOS ignored (the random checkpoint stops only at the
request's stop ids, as ours does).

Threads and processes are set by the environment bench/bench.py starts it with (vLLM's
own variables): VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps its engine core in this process;
VLLM_CPU_OMP_THREADS_BIND names the cores its OpenMP threads run on.
"""
import json
import sys
import time


def cpu_seconds():
    """CPU time of this process and its children (vLLM's engine-core process, when
    it has one)"""
    import psutil   # one of vLLM's requirements
    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


if __name__ == "__main__":   # vLLM may spawn its engine process, which re-imports this file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, max_model_len, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32",
              max_model_len=max_model_len, enable_prefix_caching=True, block_size=32, seed=seed,
              logprobs_mode="processed_logprobs")
    print("RESULT", json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        params = SamplingParams(n=req["n"], temperature=req["temperature"], top_p=1.0, top_k=0,
                                max_tokens=req["max_tokens"], stop_token_ids=req["stop_token_ids"],
                                ignore_eos=True, logprobs=0, detokenize=False,
                                seed=req.get("seed"))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        llm.reset_prefix_cache()   # every timed call starts cold, as ours does
        c0, t0 = cpu_seconds(), time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        samples = [c for o in outs for c in o.outputs]
        print("RESULT", json.dumps({
            "seconds": seconds, "cpu_seconds": cpu,
            "completions": [list(c.token_ids) for c in samples],
            "logprobs": [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
                         for c in samples],
        }), flush=True)
