r"""
An OpenAI-compatible HTTP server over InferenceEngine that hands back what a trainer
needs: token ids, logprobs.

    python -m scaleout.serve --model_path=out/qwen_small/grpo/ckpt    # http://127.0.0.1:8000/v1
    python -m scaleout.serve --model_path=DIR --port=8001 --api_key=secret \
        --enable_weight_updates=True

Endpoints, with vLLM's and SGLang's names and shapes, so the openai client and agent
frameworks work unchanged: GET /health, GET /v1/models (max_model_len, stop_token_ids),
POST /v1/completions and /v1/chat/completions (stream=true too), vLLM's token-in /
token-out POST /inference/v1/generate, POST /tokenize and /detokenize, and new weights
(off unless started with --enable_weight_updates=True): POST /update_weights_from_disk
{"model_path": DIR} (SGLang's), or vLLM's (0.32.0) RL API, over a process group of the
trainer's (weight_sync.ServerWeights is the trainer's side): /init_weight_transfer_engine
once, then /start_weight_update, /update_weights, /finish_weight_update per version,
/update_weight_version, /weight_info, /get_world_size, /shutdown_weight_transfer_engine;
and vLLM's POST /pause (mode abort, wait or keep), /resume and GET /is_paused
(scaleout/engine_loop.py). Extras on both generation
endpoints: return_token_ids=true adds prompt_token_ids and each choice's token_ids
(the exact ids sampled, a stop token included); each choice carries weight_version
(the oldest weights that sampled a token of it); logprobs are log_softmax(logits / T)
at the sampled token, the engine's own numbers. scaleout/client.py turns a response
into a TrainingSample and continues a conversation by token ids (chat uses the
checkpoint's template). With a seed, /v1/completions' prompt i draws as prompt
first_index + i (default 0) of one engine.generate call, so a rollout split across
servers samples what one engine would (scaleout/rollout_servers.py).

A request's path: its handler checks the JSON (a bad field: 400, the OpenAI error body
naming it, nothing queued), makes the prompt ids and hands them to the EngineLoop
(scaleout/engine_loop.py), whose one thread owns the engine and batches every client's
samples together. Deltas come back through an asyncio queue and become one response or,
streaming, server-sent events. A client that goes away has its samples aborted.
"""

import asyncio
import contextlib
import hmac
import json
import math
import re
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from checkpoint import (hf_to_ours, hf_weight_shapes, load_config, load_hf_checkpoint,
                        stop_ids_of)
from checks import is_int, require
from configurator import run_cli
from engine import (EngineConfig, InferenceEngine, SamplingParams, check_fits, check_prompt,
                    decode_graph_fits)
from model import as_dtype
from scaleout.engine_loop import EngineLoop
from scaleout import weight_sync
from scaleout.weight_sync import PeerGroup
from tokenizer import check_template_kwargs, chat_ids, load_tokenizer

# -----------------------------------------------------------------------------
# settings (--key=value overrides these)
model_path = ""              # a model directory with its tokenizer (any stage's {out_dir}/ckpt)
host = "127.0.0.1"           # only this machine, unless told otherwise
port = 8000
device = "cpu"
dtype = "float32"
served_model_name = ""    # the name clients send as "model"; '' = model_path as given
api_key = ""              # '' = no key; else every endpoint wants "Authorization: Bearer <api_key>"
enable_weight_updates = False  # /update_weights_from_disk and vLLM's RL routes (docs/serving.md)
max_batch_size = 64          # sequences in one engine step
max_num_batched_tokens = 2048
max_model_len = 0            # prompt + completion; 0 = the model's max_position_embeddings
num_blocks = 0               # KV blocks; 0 = sized from memory
block_size = 16
# 'paged' | 'radix' (token-granular: a chat's next turn reuses all of its history)
cache_type = "paged"
# decode steps as one compiled graph (engine.py's compile): more throughput end to end on a
# CPU, for a compile at startup (the log says how long; docs/serving.md has both). None: on
# where that graph runs (the CPU in float32, experts' widths in multiples of 4), off elsewhere;
# --compile=True / False decides
compile = None
seed = 0                     # seeds the sampling of requests without a seed
# the most top_logprobs a request may ask for
max_logprobs = 20
# uvicorn's
log_level = "warning"
# -----------------------------------------------------------------------------


class BadRequest(Exception):
    """A request the server refuses: HTTP status and the OpenAI error body naming the
    field."""

    def __init__(self, message, param=None, status=400, kind="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self):
        return error_body(self.message, self.param, self.status, self.kind)


# OpenAI's error shape
def error_body(message, param=None, status=400, kind="invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Server:
    """What the handlers share: the engine's owner loop, the tokenizer, the served name
    and the rules."""

    def __init__(self, engine, tokenizer, name, api_key="", enable_weight_updates=False, eos_ids=(),
                 max_logprobs=20):
        self.engine, self.tokenizer, self.name, self.max_logprobs = (engine, tokenizer, name,
                                                                     max_logprobs)
        self.api_key, self.enable_weight_updates = api_key, enable_weight_updates
        self.vocab_size, self.max_model_len = engine.model.config.vocab_size, engine.max_model_len
        self.eos_ids = frozenset(eos_ids) | {tokenizer.eos_token_id} - {None}
        self.loop = EngineLoop(engine, tokenizer)
        # vLLM's weight transfer: (the trainer's group, its TransferInit) once initialized;
        # the tensors of the update under way (between start and finish), else None; the
        # versions' labels (vLLM's weight_version, a str: "default" at first)
        self.transfer, self.update, self.labels = None, None, {0: "default"}
        self.weights_lock = asyncio.Lock()
        # the served model's tensors, {name: shape}, under their checkpoint names (one
        # tensor per expert): what an update must match, as vLLM's load_weights takes them
        self.layout = hf_weight_shapes(engine.model.config)

    def label(self, version):
        return self.labels.get(version, str(version))


# -----------------------------------------------------------------------------
# reading a request: one line per rule, each naming its field


def _field(body, name, kinds, default, ok=lambda v: True, rule=""):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        expected = " or ".join(k.__name__ for k in kinds)
        raise BadRequest(f"{name} must be {expected}, got {value!r}", name)
    if not ok(value):
        raise BadRequest(f"{name} {rule}, got {value!r}", name)
    return value


def _ids_list(x):   # a non-empty list of token ids
    return isinstance(x, list) and len(x) > 0 and all(is_int(t) for t in x)


_UNSUPPORTED = dict(best_of=1, echo=False, suffix=None, logit_bias=None, presence_penalty=0,
                    frequency_penalty=0, tools=None, response_format=None, use_beam_search=False,
                    repetition_penalty=1, min_p=0, min_tokens=0)


def read_sampling(server, body, logprobs_k, prompts):
    """(SamplingParams, n, stop strings) of a request, every field checked against its
    rule."""
    for name, off in _UNSUPPORTED.items():
        if body.get(name) not in (None, off):
            raise BadRequest(f"{name}={body[name]!r} is not supported by this server", name)
    n = _field(body, "n", (int,), 1, lambda v: 1 <= v <= server.engine.config.max_batch_size,
               f"must be in [1, {server.engine.config.max_batch_size}]")
    default_tokens = 16 if "messages" not in body else server.max_model_len - max(map(len, prompts))
    max_tokens = _field(body, "max_completion_tokens", (int,), None, lambda v: v >= 1,
                        "must be >= 1")
    max_tokens = _field(body, "max_tokens", (int,), max_tokens or default_tokens, lambda v: v >= 1,
                        "must be >= 1")
    temperature = _field(body, "temperature", (int, float), 1.0,
                         lambda v: math.isfinite(v) and v >= 0, "must be a finite number >= 0")
    top_p = _field(body, "top_p", (int, float), 1.0,
                   lambda v: 0 < v <= 1, "must be in (0, 1]")
    top_k = _field(body, "top_k", (int,), 0,
                   lambda v: v >= -1, "must be -1 or 0 (off), or >= 1")
    seed = _field(body, "seed", (int,), None,
                  lambda v: 0 <= v < 2 ** 64, "must be in [0, 2**64)")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else _field(body, "stop", (list,), [])
    if not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop must be a non-empty string or a list of them, got {stop!r}", "stop")
    stop_ids = _field(body, "stop_token_ids", (list,), [],
                      lambda v: all(isinstance(t, int) and 0 <= t < server.vocab_size for t in v),
                      f"must be ids in [0, {server.vocab_size})")
    eos = set() if _field(body, "ignore_eos", (bool,), False) else server.eos_ids
    if max(map(len, prompts)) + max_tokens > server.max_model_len:
        raise BadRequest(f"max_tokens={max_tokens} with a prompt of {max(map(len, prompts))} "
                         f"tokens exceeds max_model_len={server.max_model_len}", "max_tokens")
    try:
        params = SamplingParams(temperature=float(temperature), max_tokens=max_tokens,
                                top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
                                stop_token_ids=frozenset(stop_ids) | eos, top_logprobs=logprobs_k)
        for prompt in prompts:
            check_fits(prompt, params, n, server.engine.cache,
                       server.max_model_len, "prompt")
    except ValueError as e:
        field = re.search(r"SamplingParams\.(\w+)", str(e))
        raise BadRequest(str(e), field.group(1) if field else "prompt") from None
    return params, n, stop


def completion_prompts(server, body):
    """Token ids of each prompt: text, a list of ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _ids_list(prompt):
        prompt = [prompt]
    if not (isinstance(prompt, list) and prompt
            and all(isinstance(p, str) or _ids_list(p) for p in prompt)):
        raise BadRequest(f"prompt={prompt!r:.40}: not text, ids or a non-empty list", "prompt")
    ids = [server.tokenizer.encode(p) if isinstance(p, str) else p for p in prompt]
    return [_checked(server, p, f"prompt[{i}]" if len(ids) > 1 else "prompt")
            for i, p in enumerate(ids)]


def chat_prompt(server, body, add_generation_prompt=True):
    """Token ids of the conversation in the checkpoint's chat template, generation prompt
    included (unless add_generation_prompt=False)."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages):
        raise BadRequest(f"messages must be a non-empty list, got {messages!r:.80}", "messages")
    plain = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):   # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}].content: text parts only", "messages")
            content = "".join(p["text"] for p in content)
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(content, str)):
            raise BadRequest(f"messages[{i}] needs a str role and content: {m!r:.60}", "messages")
        plain.append({"role": m["role"], "content": content})
        if isinstance(m.get("reasoning_content"), str):   # a thinking template renders it
            plain[-1]["reasoning_content"] = m["reasoning_content"]
    try:   # as vLLM: chat_template_kwargs reach the template ({"enable_thinking": false})
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else check_template_kwargs(server.tokenizer, kwargs)
    except ValueError as e:
        raise BadRequest(str(e), "chat_template_kwargs") from None
    try:   # the template raises on what it cannot render (an unknown role, ...)
        ids = chat_ids(server.tokenizer, plain, add_generation_prompt, **kwargs)
    except ValueError as e:
        raise BadRequest(f"messages: {e}", "messages") from None
    return _checked(server, ids, "messages")


def _checked(server, ids, where):
    try:
        return check_prompt(ids, server.vocab_size, server.max_model_len, where)
    except (ValueError, TypeError) as e:
        raise BadRequest(str(e), where.split("[")[0]) from None   # prompt[1] -> prompt


def read_logprobs(server, body, chat):
    """How many top alternatives to record per token (0: the sampled one only), and
    whether logprobs are on."""
    if chat:
        on = _field(body, "logprobs", (bool,), False)
        k = _field(body, "top_logprobs", (int,), 0, lambda v: 0 <= v <= server.max_logprobs,
                   f"must be in [0, {server.max_logprobs}]")
        if k and not on:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return on, k
    k = _field(body, "logprobs", (int,), None, lambda v: 0 <= v <= server.max_logprobs,
               f"must be in [0, {server.max_logprobs}]")
    return k is not None, k or 0


# -----------------------------------------------------------------------------
# running a request: Deltas from the engine's owner thread, until every choice has finished


class Choice:
    """One choice as it grows: the sampled ids, their logprobs and versions, its text."""

    def __init__(self, index, prompt_ids):
        self.index, self.prompt_ids = index, prompt_ids
        self.ids, self.logprobs, self.tops, self.versions, self.text = [], [], [], [], ""
        self.finish_reason = None

    def add(self, d):
        self.ids += d.token_ids
        self.logprobs += d.logprobs
        self.tops += d.top_logprobs
        self.versions += d.versions
        self.text += d.text
        self.finish_reason = d.finish_reason


async def deltas_of(server, http, prompts, params, n, stop, first_index=0, stream=True):
    """Yield lists of Deltas until every choice has finished (stream=False: a choice's
    Deltas may come as one, at its end). A client that disconnects (seen while waiting,
    or as this generator being closed) has what is left of its request aborted in the
    engine."""
    queue, loop = asyncio.Queue(), asyncio.get_running_loop()

    def emit(deltas):   # called on the owner thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, deltas)
        except RuntimeError:
            # the event loop is gone (shutting down): nobody is listening
            pass

    request = server.loop.submit(prompts, params, n, stop, emit, first_index, stream)
    left, checked = len(prompts) * n, time.monotonic()
    try:
        while left:
            try:
                deltas = await asyncio.wait_for(queue.get(), timeout=0.1)
            except asyncio.TimeoutError:
                deltas = []
            # is the client still there? (an instant, non-blocking look)
            if time.monotonic() - checked > 0.1:
                if await http.is_disconnected():
                    return
                checked = time.monotonic()
            for d in deltas:
                if d.error:
                    raise BadRequest(d.error, None, 500, "internal_server_error")
                left -= d.finish_reason is not None
            if deltas:
                yield deltas
    finally:
        if left:
            server.loop.abort(request)


# a special token is shown as itself in logprobs (it is cut from the text)
def token_text(tokenizer, token_id):
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, ids, logprobs, tops, offset):
    """OpenAI completions logprobs: tokens, token_logprobs, top_logprobs,
    text_offset (from offset)."""
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    top = [{token_text(tokenizer, t): lp for t, lp in alts} for alts in tops] if tops else None
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(tokenizer, ids, logprobs, tops):
    """OpenAI chat logprobs: content[j] = {token, logprob, bytes, top_logprobs}."""
    def entry(t, lp):
        text = token_text(tokenizer, t)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}
    tops = tops or [()] * len(ids)
    return {"content": [dict(entry(t, lp), top_logprobs=[entry(a, b) for a, b in alts])
                        for t, lp, alts in zip(ids, logprobs, tops)]}


def usage(prompts, n, choices):
    p, c = sum(map(len, prompts)), sum(len(ch.ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


# -----------------------------------------------------------------------------
# the two generation endpoints


def new_choices(prompts, n):
    return [Choice(p * n + j, prompt) for p, prompt in enumerate(prompts) for j in range(n)]


async def completions(server, http, body):
    prompts = completion_prompts(server, body)
    want_logprobs, k = read_logprobs(server, body, chat=False)
    params, n, stop = read_sampling(server, body, k, prompts)
    ids_back = _field(body, "return_token_ids", (bool,), False)
    stream = _field(body, "stream", (bool,), False)
    # seeded: prompt i draws as prompt first_index + i of one engine.generate call (a
    # trainer's share of a rollout split across servers draws what one engine would)
    first = _field(body, "first_index", (int,), 0, lambda v: 0 <= v < 2 ** 63,
                   "must be in [0, 2**63)")
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": server.name}
    choices = new_choices(prompts, n)

    def choice_body(ch, d=None):
        # the whole choice, or (streaming) the part that Delta d added
        ids, lps, tops, text = (ch.ids, ch.logprobs, ch.tops, ch.text) if d is None else \
            (d.token_ids, d.logprobs, d.top_logprobs, d.text)
        offset = len(ch.text) - len(text)
        out = {"index": ch.index, "text": text, "finish_reason": ch.finish_reason,
               "logprobs": completion_logprobs(server.tokenizer, ids, lps, tops if k else [],
                                               offset) if want_logprobs else None}
        if ids_back:
            out.update(token_ids=ids, **({"prompt_token_ids": ch.prompt_ids} if d is None or
                                         len(ch.ids) == len(ids) else {}))
        if ch.finish_reason:
            out["weight_version"] = min(ch.versions,
                                        default=server.engine.get_weight_version())
        return out

    if stream:
        return sse(server, http, prompts, params, n, stop, choices, body, head,
                   lambda ch, d: [choice_body(ch, d)], first)
    async for deltas in deltas_of(server, http, prompts, params, n, stop, first, stream=False):
        for d in deltas:
            choices[d.index].add(d)
    return dict(head, choices=[choice_body(ch) for ch in choices],
                usage=usage(prompts, n, choices))


async def chat_completions(server, http, body):
    prompt = chat_prompt(server, body)
    want_logprobs, k = read_logprobs(server, body, chat=True)
    params, n, stop = read_sampling(server, body, k, [prompt])
    ids_back = _field(body, "return_token_ids", (bool,), False)
    stream = _field(body, "stream", (bool,), False)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": server.name}
    choices = new_choices([prompt], n)

    def logprobs(ids, lps, tops):
        return chat_logprobs(server.tokenizer, ids, lps,
                             tops if k else []) if want_logprobs else None

    def extras(ch, ids):
        return dict({"token_ids": ids} if ids_back else {},
                    **({"weight_version": min(ch.versions,
                                              default=server.engine.get_weight_version())}
                       if ch.finish_reason else {}))

    def chunk_choices(ch, d):   # streaming: the role first, then the content as it comes
        first = len(ch.ids) == len(d.token_ids)
        role = [{"index": ch.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}] if first else []
        return role + [dict({"index": ch.index, "delta": {"content": d.text},
                             "finish_reason": ch.finish_reason,
                             "logprobs": logprobs(d.token_ids, d.logprobs, d.top_logprobs)},
                            **extras(ch, d.token_ids))]

    if stream:
        head = dict(head, object="chat.completion.chunk",
                    **({"prompt_token_ids": prompt} if ids_back else {}))
        return sse(server, http, [prompt], params, n, stop, choices, body, head,
                   chunk_choices)
    async for deltas in deltas_of(server, http, [prompt], params, n, stop, stream=False):
        for d in deltas:
            choices[d.index].add(d)
    return dict(head,
                choices=[dict({"index": ch.index,
                               "message": {"role": "assistant", "content": ch.text},
                               "finish_reason": ch.finish_reason,
                               "logprobs": logprobs(ch.ids, ch.logprobs, ch.tops)},
                              **extras(ch, ch.ids)) for ch in choices],
                **({"prompt_token_ids": prompt} if ids_back else {}),
                usage=usage([prompt], n, choices))


async def generate_tokens(server, http, body):
    """POST /inference/v1/generate, vLLM's token-in / token-out endpoint (what verifiers'
    training client calls): {token_ids, sampling_params: {max_tokens, temperature,
    top_p, top_k, seed, n, stop, stop_token_ids, ignore_eos, logprobs, ...}} ->
    {request_id, prompt_token_ids, choices: [{index, token_ids, finish_reason, logprobs:
    {content: [{token: "token_id:<id>", logprob}]}, weight_versions: [{version, start,
    end}]}], usage}. Advisory keys this server
    has no use for (skip_special_tokens, cache_salt, priority, ...) are accepted; a
    missing max_tokens means up to max_model_len."""
    prompt = body.get("token_ids")
    if not _ids_list(prompt):
        raise BadRequest(f"token_ids: a non-empty list of ids, not {prompt!r:.60}", "token_ids")
    prompt = _checked(server, prompt, "token_ids")
    sampling = dict(_field(body, "sampling_params", (dict,), {}))
    try:
        k = _field(sampling, "logprobs", (int,), None, lambda v: 0 <= v <= server.max_logprobs,
                   f"must be in [0, {server.max_logprobs}]")
        if sampling.get("max_tokens") is None:
            sampling["max_tokens"] = server.max_model_len - len(prompt)
        params, n, stop = read_sampling(server, sampling, k or 0, [prompt])
    except BadRequest as e:   # name the field where the request has it
        raise BadRequest(e.message, f"sampling_params.{e.param}" if e.param else None) from None
    if _field(body, "stream", (bool,), False):
        raise BadRequest("stream=true is not supported on /inference/v1/generate", "stream")
    choices = new_choices([prompt], n)
    async for deltas in deltas_of(server, http, [prompt], params, n, stop, stream=False):
        for d in deltas:
            choices[d.index].add(d)

    def logprobs(ch):
        # the token spelled as vLLM spells it when it returns ids: token_id:<id>
        tops = ch.tops or [()] * len(ch.ids)
        return {"content": [{"token": f"token_id:{t}", "logprob": lp, "top_logprobs": [
            {"token": f"token_id:{a}", "logprob": b} for a, b in alts]}
            for t, lp, alts in zip(ch.ids, ch.logprobs, tops)]}
    return {"request_id": f"gen-{uuid.uuid4().hex}", "prompt_token_ids": prompt,
            "choices": [{"index": ch.index, "token_ids": ch.ids, "finish_reason": ch.finish_reason,
                         "logprobs": logprobs(ch) if k is not None else None,
                         "weight_version": min(ch.versions,
                                               default=server.engine.get_weight_version()),
                         "weight_versions": version_spans(ch.versions, server.label)}
                        for ch in choices], "usage": usage([prompt], n, choices)}


def version_spans(versions, label):
    """vLLM's weight_versions of a choice: the runs of its tokens sampled by one version,
    by label: [{"version": "default", "start": 0, "end": 12}, {"version": "7", "start": 12,
    "end": 30}]."""
    spans = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == label(v):
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": label(v), "start": i, "end": i + 1})
    return spans


async def tokenize(server, http, body):
    """POST /tokenize as vLLM spells it: {prompt, add_special_tokens} or {messages,
    add_generation_prompt} -> {count, max_model_len, tokens}: the ids this server would
    sample from (with messages: the chat template's, the generation prompt included
    unless told otherwise)."""
    if "messages" in body:
        ids = chat_prompt(server, body,
                          _field(body, "add_generation_prompt", (bool,), True))
    else:
        prompt = _field(body, "prompt", (str,), None)
        if prompt is None:
            raise BadRequest("prompt (a string) or messages is required", "prompt")
        special = _field(body, "add_special_tokens", (bool,), True)
        ids = server.tokenizer.encode(prompt, add_special_tokens=special)
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": list(ids)}


async def detokenize(server, http, body):
    """POST /detokenize as vLLM spells it: {tokens} -> {prompt}, special tokens kept."""
    tokens = body.get("tokens")
    vocab = server.vocab_size
    if not (_ids_list(tokens) and all(0 <= t < vocab for t in tokens)):
        raise BadRequest(f"tokens={tokens!r:.40}: not a non-empty list of ids < {vocab}", "tokens")
    return {"prompt": server.tokenizer.decode(tokens, skip_special_tokens=False)}


def sse(server, http, prompts, params, n, stop, choices, body, head, chunk_choices,
        first_index=0):
    """A streaming response: one server-sent event per choice of a Delta (chat: the role
    of a choice first, in an event of its own), then usage if asked, then [DONE]."""
    options = _field(body, "stream_options", (dict,), {})
    with_usage = _field(options, "include_usage", (bool,), False)

    async def events():
        try:
            async for deltas in deltas_of(server, http, prompts, params, n,
                                          stop, first_index):
                for d in deltas:
                    choices[d.index].add(d)
                    # one choice per event: the openai SDK's accumulator
                    # (ChatCompletionStream) takes two choices of one index in a
                    # chunk for two
                    for choice in chunk_choices(choices[d.index], d):
                        yield f"data: {json.dumps(dict(head, choices=[choice]))}\n\n"
            if with_usage:
                tail = dict(head, choices=[], usage=usage(prompts, n, choices))
                yield f"data: {json.dumps(tail)}\n\n"
        except BadRequest as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# -----------------------------------------------------------------------------
# weights


def check_updates_on(server):
    if not server.enable_weight_updates:
        raise BadRequest("weight updates are off: start the server with "
                         "--enable_weight_updates=True", None, 403, "permission_error")


async def update_weights_from_disk(server, http, body):
    """Load DIR's weights, check them against the engine's (names, shapes, finite), swap
    them in between two steps; a refused directory changes nothing."""
    check_updates_on(server)
    path = _field(body, "model_path", (str,), None)
    if not path:
        raise BadRequest("model_path is required: a model directory", "model_path")
    config = server.engine.config
    try:
        model = await asyncio.to_thread(load_hf_checkpoint, path,
                                        config.device, config.dtype)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise BadRequest(f"model_path={path!r}: {e}", "model_path") from None

    try:
        version = await apply_state(server, model.state_dict())
    except (ValueError, TypeError) as e:
        raise BadRequest(f"model_path={path!r} does not fit: {e}", "model_path") from None
    return {"success": True, "message": f"loaded {path}", "weight_version": version}


async def apply_state(server, state):
    """state swapped into the engine between two steps (checked: names, shapes, finite);
    the new version."""
    def swap(engine):
        engine.update_weights(state)
        return engine.get_weight_version()
    return await asyncio.to_thread(server.loop.call, swap)


# -----------------------------------------------------------------------------
# weights: vLLM's (0.32.0) RL weight-transfer API, with this project's backend (a process
# group of the trainer's: gloo on the CPU, NCCL on CUDA; weight_sync.py has both sides).
# One weight operation at a time (server.weights_lock), as vLLM's engine runs them.


def engine_error(message):
    """What vLLM answers when its engine refuses a weight operation: 500, its error shape."""
    return BadRequest(message, None, 500, "InternalServerError")


def required_body_field(body, name, kinds, required=True):
    """body[name], vLLM's 400 (a validation error on body.<name>) when it is missing (and
    required) or of another type."""
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kinds):
        raise BadRequest(f"1 validation error: body.{name} must be a "
                         f"{' or '.join(k.__name__ for k in kinds)}; got {value!r:.60}",
                         f"body.{name}", 400, "Bad Request")
    return value


async def init_weight_transfer_engine(server, http, body):
    """{"init_info": {master_address, master_port, rank_offset, world_size, backend,
    bucket_mb}}: join the trainer's group (weight_sync.PeerGroup) as rank rank_offset of
    world_size, met at master_address:master_port; returns once every rank has joined. A
    later call (a trainer that restarted) replaces the group, and drops an update it had
    started (as vLLM's does)."""
    info = required_body_field(body, "init_info", (dict,))
    try:
        transfer = weight_sync.TransferInit(**info)
        if transfer.backend == "nccl" and not server.engine.config.device.startswith("cuda"):
            raise ValueError("backend='nccl' needs a server on CUDA; use 'gloo'")
    except (TypeError, ValueError) as e:
        raise engine_error(f"Invalid init_info for the {weight_sync.BACKEND} weight transfer: "
                           f"{e}") from None
    async with server.weights_lock:
        server.transfer, server.update = None, None
        try:
            group = await asyncio.to_thread(PeerGroup, transfer.master_address,
                                            transfer.master_port, transfer.rank_offset,
                                            transfer.world_size, transfer.backend)
        except Exception as e:   # the trainer never came: a timeout, a refused connection
            raise engine_error(f"init_weight_transfer_engine failed: {e}") from None
        server.transfer = (group, transfer)
    return {"message": "Weight transfer initialized"}


async def shutdown_weight_transfer_engine(server, http, body):
    async with server.weights_lock:
        if server.update is not None:
            raise engine_error("Cannot release a trainer connection during a weight update")
        server.transfer = None
    return {"message": "Weight transfer shut down"}


async def start_weight_update(server, http, body):
    async with server.weights_lock:
        if server.transfer is None:
            raise engine_error("Weight transfer not initialized: POST "
                               "/init_weight_transfer_engine first")
        if server.update is not None:
            raise engine_error("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        server.update = {}   # the tensors received, applied by finish_weight_update
    return {"message": "Weight update started"}


async def update_weights(server, http, body):
    """{"update_info": {names, dtype_names, shapes}} (or a list, of which this server, one
    worker, takes the first), inside a started update: every rank of the group first says
    whether the tensors fit (names not yet received this update, their shapes, float
    dtypes), so that a refusal here (500) frees the trainer and the other servers at once;
    then they arrive by the group's broadcast in buckets, are checked finite, and are kept
    for /finish_weight_update. A refusal ends the update (as vLLM's does). Answered once the
    tensors have all arrived. A call out of step (no update_info: vLLM's 400; no start:
    500) is answered at once, with no word to the group: a trainer that sends one is not
    in the protocol's step, and must initialize again."""
    info = required_body_field(body, "update_info", (dict, list))
    async with server.weights_lock:
        if server.transfer is None or server.update is None:
            raise engine_error("start_weight_update must be called before update_weights.")
        group, transfer = server.transfer
        problem = weight_sync.update_problem(info, server.layout, set(server.update))
        try:
            tensors = await asyncio.to_thread(weight_sync.receive_update, group, transfer, info,
                                              problem, server.engine.config.device)
        except Exception as e:
            server.update = None
            raise engine_error(f"update_weights failed: {e}") from None
        if tensors is None:   # refused, here or by another rank: the update ends
            server.update = None
            raise engine_error(f"Invalid update_info: {problem}" if problem else
                               "another rank of the group refused this update")
        server.update.update(tensors)
    return {"message": "Weights updated"}


async def finish_weight_update(server, http, body):
    """Apply what /update_weights received (every tensor of the model), whole, between two
    engine steps (version += 1); {"weight_version": str} labels the new version, else it
    keeps the label before it (vLLM's version changes only when told)."""
    label = required_body_field(body, "weight_version", (str,), required=False)
    async with server.weights_lock:
        if server.update is None:
            raise engine_error("finish_weight_update called without a matching "
                               "start_weight_update.")
        update, server.update = server.update, None
        before = server.engine.get_weight_version()
        if update:
            missing = sorted(set(server.layout) - set(update))
            if missing:
                raise engine_error(f"finish_weight_update: {len(missing)} tensors never came, "
                                   f"e.g. {missing[:3]}; nothing applied")
            try:
                ours = hf_to_ours(update, server.engine.model.config)
                version = await apply_state(server, ours)
            except (ValueError, TypeError) as e:
                raise engine_error(f"finish_weight_update: {e}") from None
            server.labels[version] = label or server.label(before)
        elif label is not None:
            server.labels[before] = label
    return {"message": "Weight update finished"}


async def update_weight_version(server, http, body):
    label = required_body_field(body, "new_version", (str,))
    async with server.weights_lock:
        server.labels[server.engine.get_weight_version()] = label
    return {"success": True, "new_version": label}


# -----------------------------------------------------------------------------
# the app


_POST_ENDPOINTS = {   # a plain dict at the top level would count as a setting: hence the _
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
    "/inference/v1/generate": generate_tokens,
    "/tokenize": tokenize,
    "/detokenize": detokenize,
    "/update_weights_from_disk": update_weights_from_disk,
}
# vLLM's RL routes (served, as vLLM's are only in its dev mode, when taking weights): a body,
# where one is read, may be left out
_RL_ENDPOINTS = {
    "/init_weight_transfer_engine": init_weight_transfer_engine,
    "/shutdown_weight_transfer_engine": shutdown_weight_transfer_engine,
    "/start_weight_update": start_weight_update,
    "/update_weights": update_weights,
    "/finish_weight_update": finish_weight_update,
    "/update_weight_version": update_weight_version,
}


def add_rl_routes(app, server):
    """vLLM's (0.32.0) RL routes that read no JSON body: POST
    /pause?mode=abort|wait|keep&clear_cache=true|false -> {"status": "paused"} (once paused:
    EngineLoop.pause), POST /resume -> {"status": "resumed"}, GET /is_paused ->
    {"is_paused": bool} (a bad query value is vLLM's 400); GET /weight_info ->
    {"weight_version": label}, GET /get_world_size -> {"world_size": 1} (this process)."""
    @app.get("/weight_info")
    async def weight_info():
        return {"weight_version": server.label(server.engine.get_weight_version())}

    @app.get("/get_world_size")
    async def get_world_size():
        return {"world_size": 1}

    def query(http, name, allowed, default):
        value = http.query_params.get(name, default)
        if value.lower() not in allowed:
            raise BadRequest(f"{name}={value!r}: expected one of {sorted(set(allowed))}",
                             f"query.{name}", 400, "Bad Request")
        return allowed[value.lower()]

    @app.post("/pause")
    async def pause(http: Request):
        truth = {"true": True, "1": True, "yes": True, "on": True,
                 "false": False, "0": False, "no": False, "off": False}
        try:
            mode = query(http, "mode", {m: m for m in ("abort", "wait", "keep")}, "abort")
            clear_cache = query(http, "clear_cache", truth, "true")
        except BadRequest as e:
            return JSONResponse(e.body(), e.status)
        try:
            await asyncio.to_thread(server.loop.pause, mode, clear_cache)
        except RuntimeError as e:   # resumed before it completed; the server shutting down
            return JSONResponse({"error": f"Failed to pause generation: {e}"}, 500)
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        try:
            await asyncio.to_thread(server.loop.resume)
        except RuntimeError as e:
            return JSONResponse({"error": f"Failed to resume generation: {e}"}, 500)
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": server.loop.paused()}


async def body_of(server, http):
    """The request's JSON object, or a BadRequest naming what is wrong with it."""
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    if body.get("model") not in (None, server.name):
        raise BadRequest(f"model={body['model']!r}: this server serves {server.name!r}", "model")
    return body


def build_app(server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # on shutdown (Ctrl-C): the owner thread ends its requests
        await asyncio.to_thread(server.loop.close)

    app = FastAPI(title="nano-rl serve", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    key = f"Bearer {server.api_key}".encode()

    @app.middleware("http")
    async def check_key(http: Request, call_next):
        sent = http.headers.get("authorization", "").encode()
        if server.api_key and not hmac.compare_digest(sent, key):
            return JSONResponse(error_body("missing or wrong API key: send 'Authorization: "
                                           "Bearer <key>'", None, 401, "authentication_error"), 401)
        return await call_next(http)

    def endpoint(path, handler, optional_body=False):
        async def run(http: Request):
            try:
                empty = optional_body and not (await http.body()).strip()
                body = {} if empty else await body_of(server, http)
                out = await handler(server, http, body)
            except BadRequest as e:
                return JSONResponse(e.body(), e.status)
            return out if isinstance(out, Response) else JSONResponse(out)
        app.post(path)(run)

    for path, handler in _POST_ENDPOINTS.items():
        endpoint(path, handler)
    for path, handler in _RL_ENDPOINTS.items() if server.enable_weight_updates else ():
        endpoint(path, handler, optional_body=True)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    if server.enable_weight_updates:   # vLLM serves these only in its dev mode
        add_rl_routes(app, server)

    # the engine's counters, read on its own thread, and the largest batch it has stepped
    @app.get("/stats")
    async def stats():
        return dict(await asyncio.to_thread(server.loop.call, lambda engine: engine.stats()),
                    peak_batch=server.loop.peak_batch)

    @app.get("/v1/models")
    async def models():
        card = {"id": server.name, "object": "model", "created": int(time.time()),
                "owned_by": "nano-rl",
                "max_model_len": server.max_model_len,
                "weight_version": server.engine.get_weight_version(),
                "stop_token_ids": sorted(server.eos_ids)}   # what ends a reply unless ignore_eos
        return {"object": "list", "data": [card]}

    return app


def main(config):
    """The server of config's settings (configure has set them as this module's globals:
    run_cli below)."""
    require(config["model_path"], "model_path is required: --model_path=DIR (a model directory)")
    require(0 <= config["port"] < 65536, f"port must be in [0, 65536), got {config['port']}")
    tokenizer = load_tokenizer(model_path)
    graph = compile if compile is not None else (   # on where the decode graph runs: CPUs
        torch.device(device).type == "cpu"
        and decode_graph_fits(load_config(model_path), device, as_dtype(dtype))[0])
    engine = InferenceEngine(EngineConfig(
        model_path=model_path, device=device, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len or None,
        num_blocks=num_blocks or None, block_size=block_size, cache_type=cache_type,
        compile=graph))
    if engine.static is not None:
        print("compiling the decode step (--compile=False skips it)", flush=True)
        print(f"decode step compiled in {engine.static.warm_up():.1f} s", flush=True)
    server = Server(engine, tokenizer, served_model_name or model_path, api_key,
                    enable_weight_updates, stop_ids_of(model_path, tokenizer),
                    max_logprobs)
    print(f"serving {server.name!r} on http://{host}:{port}/v1 ({engine.cache.num_blocks} KV "
          f"blocks)", flush=True)
    # keep idle connections longer than clients pool them (httpx: 5 s), so that a
    # client never reuses one the server is closing at that moment ("disconnected
    # without a response")
    uvicorn.run(build_app(server), host=host, port=port, log_level=log_level,
                timeout_graceful_shutdown=5, timeout_keep_alive=30)


if __name__ == "__main__":
    run_cli(main, globals(), "serve")
