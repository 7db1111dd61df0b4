"""
scaleout/serve.py through the real openai client against a real server process, checked
against transformers and the engine in-process on the same checkpoint;
scaleout/client.py's token-exact conversations.
"""

import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoTokenizer, Qwen3MoeConfig

from checkpoint import load_hf_checkpoint
from scaleout.client import next_turn_prompt, sample_from_response
from conftest import write_hf_checkpoint
from engine import EngineConfig, InferenceEngine, SamplingParams
from tokenizer import IM_END, build_tokenizer, generation_stop_ids, save_tokenizer

KEY = "test-key"
EXTRA = {"return_token_ids": True}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(vocab_size):
    return Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                          moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=256, tie_word_embeddings=False,
                          decoder_sparse_step=1, mlp_only_layers=[])


def model_dir(path, seed):
    """A random transformers checkpoint with the project's tokenizer: what
    scaleout/serve.py is pointed at."""
    tok = build_tokenizer()
    hf, _ = write_hf_checkpoint(tiny_config(len(tok)), path, seed=seed)
    save_tokenizer(tok, path)
    return hf


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A scaleout/serve.py process on a free port; stop() sends Ctrl-C and returns
    its exit code. eager=False: the server's default decode step (compiled on the CPU:
    tens of seconds at startup); else --compile=False, as most tests need no compile."""

    def __init__(self, path, *args, eager=True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        args = ("--compile=False", *args) if eager else args
        self.proc = subprocess.Popen([sys.executable, "-m", "scaleout.serve",
                                      f"--model_path={path}", f"--port={self.port}",
                                      "--max_model_len=256", *args], env=env, cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        headers = {"Authorization": f"Bearer {KEY}"} if any(a.startswith("--api_key")
                                                            for a in args) else {}
        for _ in range(3000):   # 5 minutes: a cold compile on a loaded machine
            if self.proc.poll() is not None:
                raise RuntimeError(f"scaleout/serve.py exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("scaleout/serve.py did not come up")

    def stop(self):
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        finally:
            self.proc.kill()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    hf = model_dir(root / "a", seed=1)
    model_dir(root / "b", seed=2)
    # the server as it starts by default: decode steps as one compiled graph
    server = Served(root / "a", f"--api_key={KEY}", "--enable_weight_updates=True",
                    "--served_model_name=tiny", eager=False)
    yield dict(root=root, hf=hf, server=server,
               api=OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0),
               tok=build_tokenizer())
    assert server.stop() == 0, "Ctrl-C must shut the server down cleanly"


@pytest.fixture(scope="module")
def engine(setup):
    return InferenceEngine(EngineConfig(model_path=str(setup["root"] / "a"), max_model_len=256,
                                        num_blocks=256))


def test_a_request_told_only_at_its_end_gets_what_a_streamed_one_gets(setup):
    # EngineLoop.submit(stream=False), no stop strings: one Delta per sample, at its end
    # (no text decoded in between); the same ids, logprobs, top logprobs, versions, text
    # and finish reasons as a request reported step by step, n > 1 and preemptions included
    from scaleout.engine_loop import EngineLoop
    from scaleout.serve import Choice

    def run(stream):
        engine = InferenceEngine(EngineConfig(model_path=str(setup["root"] / "a"),
                                              max_model_len=256, num_blocks=12))
        loop, requests = EngineLoop(engine, setup["tok"]), []
        for r in range(6):
            n = [1, 4, 2][r % 3]
            prompt = [[1, 100 + r, 4, 103, 5, 24], list(range(10, 40 + r))][r % 2]
            params = SamplingParams(temperature=1.0, max_tokens=[1, 70, 40][r % 3], seed=r,
                                    top_logprobs=2)
            choices, done = [Choice(i, prompt) for i in range(n)], threading.Event()

            def emit(deltas, choices=choices, done=done):
                for d in deltas:
                    choices[d.index].add(d)
                if all(c.finish_reason for c in choices):
                    done.set()
            loop.submit([prompt], params, n, [], emit, stream=stream)
            requests.append((choices, done))
        assert all(done.wait(120) for _, done in requests)
        preempted = loop.call(lambda e: e.stats()["preemptions"])
        loop.close()
        return [[(c.ids, c.logprobs, c.tops, c.versions, c.text, c.finish_reason) for c in choices]
                for choices, _ in requests], preempted
    (stepwise, preempted), (at_end, _) = run(True), run(False)
    assert preempted > 0 and stepwise == at_end


def held_loop(setup, stop_at, messages=1):
    """An EngineLoop over model a running one seeded sample of 60 tokens (no stop ids),
    its owner held inside the Delta that brings the sample to stop_at tokens until that
    many messages (pauses, ...) are queued: what the test does next happens at that exact
    token."""
    from scaleout.engine_loop import EngineLoop
    from scaleout.serve import Choice
    engine = InferenceEngine(EngineConfig(model_path=str(setup["root"] / "a"), max_model_len=256,
                                          num_blocks=64))
    loop = EngineLoop(engine, setup["tok"])
    prompt, reached, done = [1, 100, 4, 103, 5, 24], threading.Event(), threading.Event()
    choice = Choice(0, prompt)

    def emit(deltas):   # on the owner thread
        for d in deltas:
            choice.add(d)
        if len(choice.ids) >= stop_at and not reached.is_set():
            reached.set()
            while loop.inbox.qsize() < messages:   # held until the test has queued them
                time.sleep(0.001)
        if choice.finish_reason:
            done.set()
    loop.submit([prompt], SamplingParams(temperature=1.0, max_tokens=60, seed=3), 1, [], emit)
    assert reached.wait(60)
    return loop, choice, done


def pause_at(loop, mode):
    """loop.pause(mode) from another thread: the held owner goes on to it."""
    worker = threading.Thread(target=loop.pause, args=(mode,))
    worker.start()
    worker.join(60)
    assert not worker.is_alive()


def asking(*calls):
    """Each fn(*args) on a thread of its own, started in order (each one's message queued
    before the next starts); returns the threads and {index: result or error text}."""
    out, threads = {}, []
    for i, (fn, *args) in enumerate(calls):
        def run(i=i, fn=fn, args=args):
            try:
                out[i] = fn(*args)
            except RuntimeError as e:
                out[i] = str(e)
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        time.sleep(0.05)
    return threads, out


def test_overlapping_pauses_and_a_close_while_paused_answer_every_caller(setup):
    # a 'keep' while a 'wait' is draining completes the wait (nothing steps any more)
    loop, choice, done = held_loop(setup, stop_at=5, messages=2)
    threads, out = asking((loop.pause, "wait"), (loop.pause, "keep"))
    [t.join(30) for t in threads]
    assert out == {0: None, 1: None} and len(choice.ids) == 5 and not done.is_set()
    loop.resume()
    assert done.wait(30)
    loop.close()
    # a resume before a 'wait' completes fails that pause
    loop, choice, done = held_loop(setup, stop_at=5, messages=2)
    threads, out = asking((loop.pause, "wait"), (loop.resume,))
    [t.join(30) for t in threads]
    assert out[0] == "resumed before the pause had completed" and out[1] is None
    assert done.wait(30) and not loop.paused()
    loop.close()
    # a close while paused: the request queued meanwhile hears it, later calls raise
    loop, choice, done = held_loop(setup, stop_at=5)
    pause_at(loop, "keep")
    heard = []
    loop.submit([[1, 7]], SamplingParams(max_tokens=4), 1, [], heard.extend)
    loop.close()
    assert [d.error for d in heard] == ["the server is shutting down"]
    with pytest.raises(RuntimeError, match="closed"):
        loop.call(lambda engine: None)


def teacher_forced(path, prompt, ids):
    """transformers' log p of each of ids after prompt (fp32, T = 1)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_a_sample_kept_across_a_weight_update_has_each_token_from_its_own_version(setup):
    # vLLM's pause(mode='keep'), PipelineRL's in-flight update: a sample running when the
    # weights change (a -> b) waits, then goes on with b; the cache cleared, it is
    # recomputed, so every token's logprob is exactly its recorded version's (transformers'
    # teacher-forced logprob under a before the update, under b after); a request that
    # comes in while paused waits for the resume
    from scaleout.serve import Choice
    root = setup["root"]
    loop, choice, done = held_loop(setup, stop_at=12)
    pause_at(loop, "keep")
    held = len(choice.ids)
    late, late_done = Choice(0, [1, 7]), threading.Event()
    loop.submit([[1, 7]], SamplingParams(temperature=0.0, max_tokens=4), 1, [],
                lambda ds: [late.add(d) for d in ds] and late.finish_reason and late_done.set())
    time.sleep(0.3)   # paused: nothing steps
    assert len(choice.ids) == held == 12 and not done.is_set() and not late.ids
    assert loop.paused()
    b = load_hf_checkpoint(str(root / "b"), device="cpu", dtype=torch.float32).state_dict()
    assert loop.call(lambda e: (e.update_weights(b), e.get_weight_version())[1]) == 1
    loop.resume()
    assert done.wait(60) and late_done.wait(60) and not loop.paused()
    loop.close()
    assert choice.finish_reason == "length" and len(choice.ids) == 60
    assert choice.versions == [0] * held + [1] * (60 - held)
    want_a = teacher_forced(root / "a", choice.prompt_ids, choice.ids)
    want_b = teacher_forced(root / "b", choice.prompt_ids, choice.ids)
    got = torch.tensor(choice.logprobs, dtype=torch.float64)
    assert torch.allclose(got[:held], want_a[:held], atol=1e-4)
    assert torch.allclose(got[held:], want_b[held:], atol=1e-4)
    assert not torch.allclose(got[held:], want_a[held:], atol=1e-3)   # the versions differ


def test_pause_abort_ends_samples_with_what_they_have_and_wait_lets_them_finish(setup):
    loop, choice, done = held_loop(setup, stop_at=5)
    pause_at(loop, "abort")
    assert done.wait(10) and choice.finish_reason == "abort" and len(choice.ids) == 5
    loop.resume()
    loop.close()
    loop, choice, done = held_loop(setup, stop_at=5)
    pause_at(loop, "wait")   # returns once the running sample has finished
    assert done.is_set() and choice.finish_reason == "length" and len(choice.ids) == 60
    loop.close()
    with pytest.raises(ValueError, match="mode='later'"):
        loop.pause("later")


def test_pause_routes_speak_vllms_api(setup):
    url, key = setup["server"].url, {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/is_paused", headers=key).json() == {"is_paused": False}
    r = httpx.post(url + "/pause?mode=later", headers=key)
    assert r.status_code == 400 and r.json()["error"]["param"] == "query.mode", r.text
    assert httpx.post(url + "/pause?mode=keep", headers=key).json() == {"status": "paused"}
    assert httpx.get(url + "/is_paused", headers=key).json() == {"is_paused": True}
    # a request sent while paused waits for the resume, then is answered
    with httpx.Client(timeout=60) as client:
        waiting = threading.Thread(target=lambda: setup.__setitem__("late", client.post(
            url + "/inference/v1/generate", headers=key,
            json={"token_ids": [1, 5, 9], "sampling_params": {"max_tokens": 4}})))
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive()
        assert httpx.post(url + "/resume", headers=key).json() == {"status": "resumed"}
        waiting.join(60)
    choice = setup.pop("late").json()["choices"][0]
    n = len(choice["token_ids"])
    assert choice["weight_versions"] == [{"version": choice["weight_versions"][0]["version"],
                                          "start": 0, "end": n}]
    assert httpx.post(url + "/pause", headers={}).status_code == 401   # the key guards them


DETOK_TEXTS = ["héllo wörld, ça va? 日本語のテキスト 🙂🚀 naïve café, fin.",
               "the quick brown fox can't jump . ok ! really ?"]


def bpe_tokenizer(byte_level):
    """A small BPE tokenizer trained here: byte-level (Qwen's and Llama 3's kind, whose ids
    split multi-byte characters) or SentencePiece-style (a token's leading space is
    dropped at the start of a text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    core = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    if byte_level:
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        core.pre_tokenizer, core.decoder, alphabet = (pre_tokenizers.Metaspace(),
                                                      decoders.Metaspace(), [])
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                  special_tokens=["<s>", "</s>", "<unk>"])
    core.train_from_iterator(DETOK_TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["ours", "byte-level", "sentencepiece"])
def test_text_decoded_a_step_at_a_time_is_the_whole_decode(kind, monkeypatch):
    # the server decodes only each step's new ids (after the last step's as context): the
    # text handed out, stop strings cut, must be what decoding every id at once gives,
    # through characters split over ids, invalid bytes, special tokens mid-text and a
    # leading space dropped at a text's start; and a long sample's decoding stays linear
    from scaleout import engine_loop
    from scaleout.engine_loop import SampleText
    tok = {"ours": build_tokenizer, "byte-level": lambda: bpe_tokenizer(True),
           "sentencepiece": lambda: bpe_tokenizer(False)}[kind]()
    decoded, step_decode = [], engine_loop.step_decoder(tok)   # ids given to each call

    def counted_decode(ids):
        decoded.append(len(ids))
        return step_decode(ids)
    monkeypatch.setattr(engine_loop, "step_decoder", lambda tokenizer: counted_decode)
    rng = random.Random(0)
    for trial in range(300):
        if trial % 2:   # random ids: invalid bytes and split characters
            ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 60))]
        else:           # real text, with special ids put in
            ids = tok(rng.choice(DETOK_TEXTS)[rng.randrange(40):])["input_ids"]
            for _ in range(rng.randrange(3)):
                ids.insert(rng.randrange(len(ids) + 1), rng.randrange(2))
        stop = rng.choice([[], ["a"], [" ca", "ö"], ["fox c"]])
        sample, text, i, stopped = SampleText(tok, stop), "", 0, False
        while i < len(ids) and not stopped:
            step = rng.randrange(1, 4)
            new, stopped = sample.add(ids[i:i + step], final=i + step >= len(ids))
            text, i = text + new, i + step
        whole = tok.decode(ids, skip_special_tokens=True)
        cut = min((whole.find(s) for s in stop if s in whole), default=len(whole))
        assert text == whole[:cut], (ids, stop)
    decoded.clear()
    sample, long = SampleText(tok, ["zzz"]), tok("the quick brown fox " * 200)["input_ids"]
    for i in range(len(long)):
        sample.add(long[i:i + 1], final=False)
    assert sum(decoded) < 4 * len(long), "each step decodes only its own ids and a few more"


def post(setup, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(setup["server"].url + path, json=body, headers=headers, timeout=60)


def greedy(stop, max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=frozenset(stop),
                          **kw)


def hf_greedy(hf, prompt, n, stop):
    """transformers, one token at a time: the reference greedy continuation."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop:
                break
    return ids[len(prompt):]


PROMPTS = [[1, 100, 4, 103, 5, 24, 5, 26], [7, 8, 9], list(range(10, 40))]


def test_greedy_completions_equal_engine_and_transformers(setup, engine):
    api, stop = setup["api"], generation_stop_ids(setup["tok"])
    mine = engine.generate(PROMPTS, greedy(stop))
    r = api.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0,
                               logprobs=0, extra_body=EXTRA)
    for prompt, ours, choice in zip(PROMPTS, mine, r.choices):
        extra = choice.model_extra
        assert extra["prompt_token_ids"] == prompt
        assert extra["token_ids"] == list(ours.completion_tokens) == hf_greedy(setup["hf"], prompt,
                                                                               8, stop)
        assert choice.logprobs.token_logprobs == pytest.approx(list(ours.logprobs), abs=1e-5)
        assert choice.text == setup["tok"].decode(ours.completion_tokens, skip_special_tokens=True)
        assert extra["weight_version"] == 0
    assert r.usage.prompt_tokens == sum(map(len, PROMPTS))


def test_chat_uses_the_checkpoints_template(setup, engine):
    api, stop, root = setup["api"], generation_stop_ids(setup["tok"]), setup["root"]
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "digits 3 5 7 target 22"}]
    r = api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                    logprobs=True, top_logprobs=3, extra_body=EXTRA)
    tokenizer = AutoTokenizer.from_pretrained(root / "a")
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             return_dict=False)
    assert r.model_extra["prompt_token_ids"] == list(expected)
    ours = engine.generate([expected], greedy(stop))[0]
    choice = r.choices[0]
    assert choice.model_extra["token_ids"] == list(ours.completion_tokens) == hf_greedy(setup["hf"],
                                                                                        expected, 8,
                                                                                        stop)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(list(ours.logprobs),
                                                                         abs=1e-5)
    # greedy: the sampled token is the most likely, and the list is sorted
    for c in choice.logprobs.content:
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob,
                                                          abs=1e-6) and len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs),
                                                             reverse=True)


def test_top_logprobs_equal_transformers(setup):
    api, hf = setup["api"], setup["hf"]
    prompt = PROMPTS[0]
    r = api.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0.7,
                               logprobs=4, seed=3, extra_body=EXTRA)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1] / 0.7, -1)
    values, ids = ref.topk(4)
    tops = r.choices[0].logprobs.top_logprobs[0]
    assert list(tops) == [setup["tok"].decode([i]) for i in ids.tolist()]
    assert list(tops.values()) == pytest.approx(values.tolist(), abs=1e-4)
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        ref[r.choices[0].model_extra["token_ids"][0]].item(), abs=1e-4
    )


def collect_stream(stream, chat):
    text, ids, logprobs, finish = {}, {}, {}, {}
    for chunk in stream:
        for c in chunk.choices:
            i = c.index
            text[i] = text.get(i, "") + ((c.delta.content or "") if chat else c.text)
            ids[i] = ids.get(i, []) + (c.model_extra.get("token_ids") or [])
            if c.logprobs is not None:
                new = [x.logprob for x in c.logprobs.content] if chat else c.logprobs.token_logprobs
                logprobs[i] = logprobs.get(i, []) + new
            finish[i] = c.finish_reason or finish.get(i)
    return text, ids, logprobs, finish


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_equals_non_streamed(setup, n):
    api = setup["api"]
    kw = dict(model="tiny", max_tokens=12, temperature=0.9, seed=11, n=n, extra_body=EXTRA)
    whole = api.completions.create(prompt=PROMPTS[1], logprobs=0, **kw)
    text, ids, logprobs, finish = collect_stream(api.completions.create(prompt=PROMPTS[1],
                                                                        logprobs=0, stream=True,
                                                                        **kw), chat=False)
    for c in whole.choices:
        assert (text[c.index], ids[c.index], finish[c.index]) == (c.text,
                                                                  c.model_extra["token_ids"],
                                                                  c.finish_reason)
        # the same tokens; logprobs to fp32 rounding, which depends on the rows the
        # engine computed together
        assert logprobs[c.index] == pytest.approx(c.logprobs.token_logprobs, abs=1e-5)
    messages = [{"role": "user", "content": "digits 1 2 3 target 6"}]
    whole = api.chat.completions.create(messages=messages, logprobs=True, **kw)
    text, ids, logprobs, finish = collect_stream(api.chat.completions.create(messages=messages,
                                                                             logprobs=True,
                                                                             stream=True, **kw),
                                                 chat=True)
    for c in whole.choices:
        assert (text[c.index], ids[c.index], finish[c.index]) == (c.message.content,
                                                                  c.model_extra["token_ids"],
                                                                  c.finish_reason)
        assert logprobs[c.index] == pytest.approx([x.logprob for x in c.logprobs.content], abs=1e-5)


def test_seeded_n4_repeats_and_stop_strings(setup):
    api = setup["api"]
    kw = dict(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=1.0, n=4, seed=1234,
              extra_body=EXTRA)
    a, b = api.completions.create(**kw), api.completions.create(**kw)
    ids = [c.model_extra["token_ids"] for c in a.choices]
    assert ids == [c.model_extra["token_ids"] for c in b.choices]
    assert len({tuple(x) for x in ids}) > 1, "four samples of a random model all the same"
    # a stop string: the text ends before it, and the sample ends at the token that
    # completed it (same seed)
    tok, stop = setup["tok"], a.choices[0].text[3:5]
    cut = api.completions.create(stop=[stop], **kw)
    for whole, part in zip(a.choices, cut.choices):
        full_ids, ids = whole.model_extra["token_ids"], part.model_extra["token_ids"]
        if stop not in whole.text:
            assert (part.text, ids, part.finish_reason) == (whole.text, full_ids,
                                                            whole.finish_reason)
            continue
        assert part.finish_reason == "stop" and part.text == whole.text[:whole.text.index(stop)]
        assert (ids == full_ids[: len(ids)] and stop in tok.decode(ids)
                and stop not in tok.decode(ids[:-1]))


def test_64_concurrent_requests_batch_and_match(setup):
    api = setup["api"]
    prompts = [[1 + (i % 90), 5, 2 + (i * 7) % 90, 4] for i in range(64)]
    kw = dict(model="tiny", max_tokens=32, temperature=0, extra_body=dict(EXTRA, ignore_eos=True))
    alone = [api.completions.create(prompt=p, **kw).choices[0].model_extra["token_ids"]
             for p in prompts]
    results = [None] * 64

    def one(i):
        results[i] = api.completions.create(prompt=prompts[i],
                                            **kw).choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    assert results == alone
    stats = httpx.get(setup["server"].url + "/stats",
                      headers={"Authorization": f"Bearer {KEY}"}).json()
    assert stats["peak_batch"] >= 16, stats
    assert stats["compiled_steps"] > 0, stats   # the default server's decode graph ran


BAD = [
    ("/v1/completions", dict(prompt=[1, 2], model="other"), "model"),
    ("/v1/completions", dict(prompt=""), "prompt"),
    ("/v1/completions", dict(prompt=[]), "prompt"),
    ("/v1/completions", dict(prompt=[1, 999]), "prompt"),
    ("/v1/completions", dict(prompt=[1] * 300), "prompt"),
    ("/v1/completions", dict(prompt=[1], max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(prompt=[1], max_tokens=500), "max_tokens"),
    ("/v1/completions", dict(prompt=[1], temperature=-1), "temperature"),
    ("/v1/completions", dict(prompt=[1], temperature="hot"), "temperature"),
    ("/v1/completions", dict(prompt=[1], top_p=0), "top_p"),
    ("/v1/completions", dict(prompt=[1], top_p=1.5), "top_p"),
    ("/v1/completions", dict(prompt=[1], n=0), "n"),
    ("/v1/completions", dict(prompt=[1], logprobs=99), "logprobs"),
    ("/v1/completions", dict(prompt=[1], echo=True), "echo"),
    ("/v1/chat/completions", dict(messages=[]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "tool", "content": "x"}]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user"}]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2),
     "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{b}" for _, b, _ in BAD])
def test_bad_request_is_400_naming_the_field(setup, path, body, param):
    r = post(setup, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (
        error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    ), error
    good = post(setup, "/v1/completions", dict(prompt=[1, 2], max_tokens=2))
    assert good.status_code == 200 and len(good.json()["choices"][0]["text"]) >= 0


def test_malformed_json_and_auth(setup):
    url = setup["server"].url
    r = httpx.post(url + "/v1/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for path in ("/health", "/v1/models"):
            assert httpx.get(url + path, headers=headers).status_code == 401
        assert httpx.post(url + "/v1/completions", json=dict(prompt=[1]),
                          headers=headers).status_code == 401
    assert [m.id for m in setup["api"].models.list()] == ["tiny"]


def test_disconnect_mid_stream_frees_its_sequences(setup):
    url, headers = setup["server"].url, {"Authorization": f"Bearer {KEY}"}
    body = dict(prompt=PROMPTS[1], max_tokens=250, temperature=1.0, n=4, stream=True,
                ignore_eos=True)
    before = httpx.get(url + "/stats", headers=headers).json()["generated_tokens"]
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        next(r.iter_lines())   # one event, then hang up
    for _ in range(100):
        stats = httpx.get(url + "/stats", headers=headers).json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["generated_tokens"] - before < 4 * 250, (f"the aborted samples ran to the end: "
                                                          f"{stats}")


def test_update_weights_from_disk(setup):
    root, api, stop = setup["root"], setup["api"], generation_stop_ids(setup["tok"])
    before = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body=EXTRA)
    for bad in (root / "missing", root):   # no such directory; a directory without a checkpoint
        r = post(setup, "/update_weights_from_disk", {"model_path": str(bad)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
    other = root / "wide"                  # a checkpoint of another shape: refused whole
    write_hf_checkpoint(_wider(), other)
    assert post(setup, "/update_weights_from_disk", {"model_path": str(other)}).status_code == 400
    same = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                  extra_body=EXTRA)
    # nothing changed, version included
    assert same.choices[0].model_extra == before.choices[0].model_extra
    r = post(setup, "/update_weights_from_disk", {"model_path": str(root / "b")})
    assert r.status_code == 200 and r.json()["weight_version"] == 1, r.text
    after = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                   logprobs=0, extra_body=EXTRA)
    ref = InferenceEngine(EngineConfig(model_path=str(root / "b"), max_model_len=256,
                                       num_blocks=64))
    want = ref.generate([PROMPTS[0]], greedy(stop))[0]
    assert after.choices[0].model_extra["token_ids"] == list(want.completion_tokens)
    assert after.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-5)
    assert after.choices[0].model_extra["weight_version"] == 1
    assert post(setup, "/update_weights_from_disk",
                {"model_path": str(root / "a")}).json()["weight_version"] == 2


def _wider():
    config = tiny_config(105)
    config.hidden_size = 48
    return config


def test_weight_updates_refused_unless_enabled(setup):
    server = Served(setup["root"] / "a")
    try:
        r = httpx.post(server.url + "/update_weights_from_disk",
                       json={"model_path": str(setup["root"] / "b")})
        assert r.status_code == 403 and "enable_weight_updates" in r.json()["error"]["message"]
        # vLLM's RL routes exist only on a server that takes weights (vLLM: its dev mode)
        assert httpx.post(server.url + "/pause").status_code == 404
        assert httpx.post(server.url + "/v1/models").status_code == 405
        assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == str(
            setup["root"] / "a"
        )
    finally:
        assert server.stop() == 0


def test_two_turn_conversation_is_one_token_sequence(setup):
    api, tok, root = setup["api"], setup["tok"], setup["root"]
    messages = [{"role": "user", "content": "digits 3 5 7 target 22"}]
    r1 = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                     logprobs=True, extra_body=EXTRA)
    s1 = sample_from_response(r1)
    turn2 = [{"role": "user", "content": "and the target 15?"}]
    ids = next_turn_prompt(tok, s1, turn2)
    r2 = api.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=0,
                                extra_body=EXTRA)
    s2 = sample_from_response(r2, sent=ids)
    conversation = messages + [{"role": "assistant",
                                "content": r1.choices[0].message.content}] + turn2
    template = AutoTokenizer.from_pretrained(root / "a").apply_chat_template(
        conversation, add_generation_prompt=True, return_dict=False
    )
    assert list(s2.prompt_tokens) == list(template)
    assert list(s2.prompt_tokens[:len(s1.prompt_tokens) + len(s1.completion_tokens)]) == \
        list(s1.prompt_tokens + s1.completion_tokens)
    assert s2.logprobs == tuple(r2.choices[0].logprobs.token_logprobs) and len(s2.logprobs) == len(
        s2.completion_tokens
    )
    # a reply sampled as "user" spelled in four character ids, where the tokenizer has one
    # word id: kept as sampled (never re-tokenized), then the same ids for the new turn
    bridge = ids[len(s1.prompt_tokens) + len(s1.completion_tokens):]
    if s1.finish_reason == "length":   # turn 1 was cut: its bridge starts with the <|im_end|>
        bridge = bridge[1:]
    chars = tuple(tok.convert_tokens_to_ids(c) for c in "user")
    im_end = tok.convert_tokens_to_ids(IM_END)
    stopped = dataclasses.replace(s1, completion_tokens=chars + (im_end,))
    assert next_turn_prompt(tok, stopped, turn2) == \
        list(s1.prompt_tokens + stopped.completion_tokens) + bridge
    # one cut at max_tokens gets the whole close of its turn: <|im_end|> then the newline
    cut = dataclasses.replace(s1, completion_tokens=chars)
    assert next_turn_prompt(tok, cut, turn2) == \
        list(s1.prompt_tokens + chars) + [im_end] + bridge


@pytest.mark.parametrize("n", [1, 2])
def test_the_sdks_stream_accumulator_gives_the_non_streamed_chat_completion(setup, n):
    # ChatCompletionStream (chat.completions.stream(...).get_final_completion(), what
    # harnesses use) builds the completion from the chunks itself: one role chunk per
    # choice, then the content (it refuses a choice cut at max_tokens: stop ids that a
    # random model soon samples end them)
    api = setup["api"]
    kw = dict(model="tiny", max_tokens=60, temperature=0.9, seed=5, n=n, logprobs=True,
              messages=[{"role": "user", "content": "digits 1 2 3 target 6"}],
              extra_body=dict(EXTRA, stop_token_ids=list(range(60, 70))))
    whole = api.chat.completions.create(**kw)
    with api.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert len(final.choices) == len(whole.choices) == n
    for got, want in zip(final.choices, whole.choices):
        assert (got.index, got.message.role, got.message.content, got.finish_reason) == \
            (want.index, "assistant", want.message.content, want.finish_reason)
        assert want.finish_reason == "stop" and len(want.model_extra["token_ids"]) > 1
        assert [c.logprob for c in got.logprobs.content] == \
            pytest.approx([c.logprob for c in want.logprobs.content], abs=1e-5)

    async def async_final():
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=setup["server"].url + "/v1", api_key=KEY, max_retries=0)
        async with client.chat.completions.stream(**kw) as stream:
            return await stream.get_final_completion()
    import asyncio
    final = asyncio.run(async_final())
    for got, want in zip(final.choices, whole.choices):
        assert (got.index, got.message.content, got.finish_reason) == \
            (want.index, want.message.content, want.finish_reason)
        assert [c.logprob for c in got.logprobs.content] == \
            pytest.approx([c.logprob for c in want.logprobs.content], abs=1e-5)


def test_token_in_token_out_generate_equals_the_engine(setup, engine):
    # vLLM's POST /inference/v1/generate, as verifiers' training client sends it
    # (advisory keys too)
    stop = generation_stop_ids(setup["tok"])
    mine = engine.generate(PROMPTS[:2], greedy(stop, max_tokens=8))
    for prompt, ours in zip(PROMPTS[:2], mine):
        sampling = {"max_tokens": 8, "temperature": 0.0, "logprobs": 0, "n": 1,
                    "skip_special_tokens": False, "cache_salt": "x", "priority": 0,
                    "routed_experts_prompt_start": None}
        r = post(setup, "/inference/v1/generate", {"model": "tiny", "token_ids": prompt,
                                                   "sampling_params": sampling})
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        assert body["prompt_token_ids"] == prompt
        assert choice["token_ids"] == list(ours.completion_tokens)
        assert [c["token"] for c in choice["logprobs"]["content"]] == \
            [f"token_id:{t}" for t in ours.completion_tokens]
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == \
            pytest.approx(list(ours.logprobs), abs=1e-5)
        assert body["usage"]["completion_tokens"] == len(ours.completion_tokens)
    # n samples with a seed, no max_tokens (up to max_model_len), stop ids honoured
    r = post(setup, "/inference/v1/generate", {"token_ids": PROMPTS[1], "sampling_params": {
        "n": 2, "seed": 3, "temperature": 1.0, "stop_token_ids": list(range(60, 70))}}).json()
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["logprobs"] is None
    ends = set(range(60, 70)) | set(stop)
    assert all(c["finish_reason"] == "stop" and c["token_ids"][-1] in ends or
               c["finish_reason"] == "length" and len(c["token_ids"]) == 256 - len(PROMPTS[1])
               for c in r["choices"]), r["choices"]


@pytest.mark.parametrize("body,field", [
    ({"sampling_params": {}}, "token_ids"),
    ({"token_ids": [1, 2.5]}, "token_ids"),
    ({"token_ids": [1, 10 ** 6]}, "token_ids"),
    ({"token_ids": [1, 2], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"token_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"token_ids": [1, 2], "sampling_params": {"logprobs": 99}}, "sampling_params.logprobs"),
    ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1000}}, "sampling_params.max_tokens"),
    ({"token_ids": [1, 2], "sampling_params": "greedy"}, "sampling_params"),
])
def test_bad_generate_requests_get_400_naming_the_field(setup, body, field):
    r = post(setup, "/inference/v1/generate", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert post(setup, "/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {
        "max_tokens": 2}}).status_code == 200            # and the server keeps serving


def test_tokenize_and_detokenize_as_vllm_spells_them(setup):
    tok = AutoTokenizer.from_pretrained(setup["root"] / "a")
    messages = [{"role": "user", "content": "digits 3 5 7 target 22"}]
    r = post(setup, "/tokenize", {"model": "tiny", "messages": messages}).json()
    assert r["tokens"] == list(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                       return_dict=False))
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    bare = post(setup, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert r["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < r["count"]
    text = post(setup, "/tokenize", {"prompt": "3*5+7"}).json()
    assert text["tokens"] == tok.encode("3*5+7")
    assert post(setup, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == \
        tok.decode(r["tokens"], skip_special_tokens=False)
    assert post(setup, "/detokenize", {"tokens": [-1]}).json()["error"]["param"] == "tokens"
    assert post(setup, "/tokenize", {}).json()["error"]["param"] == "prompt"
    card = httpx.get(setup["server"].url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert card.json()["data"][0]["stop_token_ids"] == sorted(generation_stop_ids(setup["tok"]))


def weight_version(setup):
    key = {"Authorization": f"Bearer {KEY}"}
    card = httpx.get(setup["server"].url + "/v1/models", headers=key).json()["data"][0]
    return card["weight_version"], httpx.get(setup["server"].url + "/weight_info",
                                             headers=key).json()["weight_version"]


def test_weights_over_a_process_group_reach_a_running_server(setup):
    # the trainer (this process) pushes b's weights to the server through vLLM's cycle
    # (start, update_weights with the bytes over a gloo group of their own, finish with a
    # version label); the server then samples exactly what an engine on b samples
    from scaleout.weight_sync import ServerWeights
    root, api, stop = setup["root"], setup["api"], generation_stop_ids(setup["tok"])
    before, _ = weight_version(setup)
    b = load_hf_checkpoint(str(root / "b")).state_dict()
    push = ServerWeights([setup["server"].url], b, bucket_mb=0.01, api_key=KEY)   # 10 KiB buckets
    embed = next(k for k in b if "embed" in k)
    wide = {**b, embed: torch.zeros(105, 48)}
    with pytest.raises(ValueError, match=f"refused \\(500\\).*{embed}.* has shape \\[105, 48\\]"):
        push.send(wide)                                     # refused before a byte is sent
    assert weight_version(setup)[0] == before               # nothing changed
    push.send(b, "step-7")
    assert weight_version(setup) == (before + 1, "step-7")
    r = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                               logprobs=0, extra_body=EXTRA)
    ref = InferenceEngine(EngineConfig(model_path=str(root / "b"), max_model_len=256,
                                       num_blocks=64))
    want = ref.generate([PROMPTS[0]], greedy(stop))[0]
    assert r.choices[0].model_extra["token_ids"] == list(want.completion_tokens)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-5)
    assert r.choices[0].model_extra["weight_version"] == before + 1
    spans = post(setup, "/inference/v1/generate", {"token_ids": [1, 5], "sampling_params": {
        "max_tokens": 3, "temperature": 0}}).json()["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["step-7"]
    a = load_hf_checkpoint(str(root / "a")).state_dict()
    push.send(a)                                            # and back, for the tests after this one
    assert weight_version(setup) == (before + 2, "step-7")  # unlabelled: vLLM's keeps its label
    # a trainer that restarts makes a new group, which replaces the old one
    ServerWeights([setup["server"].url], b, api_key=KEY).send(a)
    assert weight_version(setup)[0] == before + 3
    # a server without --enable_weight_updates has no such routes, as vLLM outside its dev mode
    server = Served(root / "a")
    try:
        r = httpx.post(server.url + "/init_weight_transfer_engine", json={"init_info": {
            "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2}})
        assert r.status_code == 404
    finally:
        assert server.stop() == 0


def test_a_server_that_refuses_the_weights_leaves_the_others_free(setup):
    # two servers, one of another shape: it refuses the update before any byte (every rank
    # says whether it fits), so nothing waits for bytes; the good one takes the next push
    from scaleout.weight_sync import ServerWeights
    root = setup["root"]
    write_hf_checkpoint(_wider(), root / "wide_served")
    save_tokenizer(build_tokenizer(), root / "wide_served")
    wide = Served(root / "wide_served", f"--api_key={KEY}", "--enable_weight_updates=True")
    try:
        before, _ = weight_version(setup)
        a = load_hf_checkpoint(str(root / "a")).state_dict()
        both = ServerWeights([setup["server"].url, wide.url], a, api_key=KEY)
        with pytest.raises(ValueError, match=f"{wide.url}.* refused \\(500\\).* has shape"):
            both.send(a)
        assert weight_version(setup)[0] == before   # the good server applied nothing either
        ServerWeights([setup["server"].url], a, api_key=KEY).send(a)
        assert weight_version(setup)[0] == before + 1
    finally:
        assert wide.stop() == 0


def test_the_weight_routes_refuse_what_vllm_refuses_and_change_nothing(setup):
    # vLLM 0.32.0's bodies and error shapes (docs/serving.md): a cycle out of order, a bad
    # init_info (a world size that does not hold this rank), a missing body field
    url, key = setup["server"].url, {"Authorization": f"Bearer {KEY}"}
    before = weight_version(setup)

    def call(path, body=None):
        return httpx.post(url + path, json=body, headers=key, timeout=60)
    r = call("/finish_weight_update")
    assert r.status_code == 500 and r.json()["error"] == {
        "message": "finish_weight_update called without a matching start_weight_update.",
        "type": "InternalServerError", "param": None, "code": 500}
    r = call("/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    assert r.status_code == 500 and "start_weight_update must be called" in r.text
    r = call("/init_weight_transfer_engine", {})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body.init_info"
    r = call("/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 1}})
    assert r.status_code == 500 and "Invalid init_info" in r.text and "world_size" in r.text
    r = call("/init_weight_transfer_engine", {"init_info": {   # NCCL on a CPU server
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
        "backend": "nccl"}})
    assert r.status_code == 500 and "needs a server on CUDA" in r.text
    r = call("/init_weight_transfer_engine", {"init_info": {   # NCCL's init_info: not ours
        "master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1, "world_size": 2,
        "packed": True}})
    assert r.status_code == 500 and "Invalid init_info" in r.text and "packed" in r.text
    assert call("/start_weight_update").json() == {"message": "Weight update started"}
    r = call("/start_weight_update")
    assert r.status_code == 500 and "already active" in r.text
    assert call("/finish_weight_update").json() == {"message": "Weight update finished"}
    r = call("/update_weight_version", {"new_version": "v-label"})
    assert r.json() == {"success": True, "new_version": "v-label"}
    assert weight_version(setup) == (before[0], "v-label")   # a label, no new weights
    call("/update_weight_version", {"new_version": before[1]})
    assert httpx.get(url + "/get_world_size", headers=key).json() == {"world_size": 1}
