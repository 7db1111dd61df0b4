"""
The engine on its own thread, for the HTTP server: one owner runs step(), every client
talks to it by message.

    loop = EngineLoop(engine, tokenizer)       # starts the owner thread
    request = loop.submit([prompt_ids], params, n=4, stop=["\\n\\n"], emit=callback)
    ...                                        # callback(list[Delta]) runs on the owner thread
    loop.submit(..., stream=False)             # no stop strings: one Delta a sample, at its end
    loop.abort(request)                        # its client went away
    loop.call(lambda engine: engine.update_weights(state_dict))   # runs between two steps
    loop.pause("keep"); ...; loop.resume()     # vLLM's pause modes: 'abort', 'wait', 'keep'
    loop.close()

InferenceEngine is single-threaded, so exactly one thread (the owner) ever touches it.
Requests, aborts and weight updates reach it through a queue; between two engine steps
it takes everything queued, so requests that arrive while a step runs join the next one
(continuous batching across HTTP requests). After each step it reports, for every sample
that moved, a Delta: the new token ids, their logprobs, the new text. The text is
detokenized here, where the stop strings are found: a sample whose text reaches one is
aborted in the engine at once (its blocks are freed) and finishes with reason 'stop'.
A request that does not stream and has no stop strings hears only when each sample ends,
with all of it: no text is decoded, and no Delta made, in the steps between.

Paused (vLLM's /pause), the loop steps no more ('wait': once the running samples have
finished; 'abort': they end at once, finish reason 'abort', with what they had), and a
request that comes in waits for resume(); 'keep' holds the running samples where they
are and goes on with them after resume(), their later tokens sampled by whatever weights
are in then (each token records its version).

The engine keeps the tokens of a running sample in engine.running (scheduler.Sequence:
tokens, num_prompt, logprobs, versions); a preempted sample keeps them while it waits,
so what was reported is never taken back.
"""

import functools
import queue
import threading
from dataclasses import dataclass

from transformers import PreTrainedTokenizerFast


@dataclass
class Delta:
    """What one sample (one choice) produced since its last Delta."""
    index: int          # the choice: prompt_index * n + sample_index
    token_ids: list     # new sampled ids (a stop token included; the stop string's tokens included)
    logprobs: list      # one per new id: log_softmax(logits / T) at it
    top_logprobs: list  # one per new id when asked: ((id, logprob), ...), else []
    versions: list      # one per new id: the weight version that sampled it
    text: str           # new text (stop strings and what follows them cut, special tokens skipped)
    finish_reason: str | None = None   # 'stop' | 'length' | 'abort' on a sample's last Delta
    error: str | None = None  # the engine failed: the request is over


class SampleText:
    """One sample's ids and text so far. Each step decodes only its new ids, after the last
    step's ids as context (as vLLM does; a tokenizer may spell a text's first token
    differently, and the context's own text, decoded the same way, is cut off again), so
    a step costs what its new ids cost, not what the whole sample does. The text is
    handed out with its last few characters held back while they could still start a
    stop string, or be an incomplete character."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids, self.sent, self.finish_reason = [], 0, None
        # the text of ids[:read], and where the last step's ids (the context) start
        self.text, self.context, self.read = "", 0, 0
        self.decode = step_decoder(tokenizer)
        self.whole = self.decode is None   # then each step decodes every id

    def add(self, ids, final):
        """Take new ids; returns (new text, stopped): stopped when a stop string appeared
        (text cut before it)."""
        self.ids += ids
        text = self._decode(final)
        cut = min((i for i in (text.find(s, max(self.sent - len(s), 0)) for s in self.stop)
                   if i >= 0), default=-1)
        if cut >= 0:
            text, final = text[:cut], True
        elif not final and self.hold:
            text = text[:max(len(text) - self.hold, 0)]
        new, self.sent = text[self.sent:], max(self.sent, len(text))
        return new, cut >= 0

    def _decode(self, final):
        """The text of every id so far, less an incomplete character at its end (whose
        other bytes are still to come) unless final."""
        if not self.whole:
            before = self.decode(self.ids[self.context:self.read])
            after = self.decode(self.ids[self.context:])
            self.whole = not after.startswith(before)   # no tokenizer seen does this
        if self.whole:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            while not final and text.endswith("\ufffd"):
                text = text[:-1]
            return text
        if final or not after.endswith("\ufffd"):
            new = after[len(before):]
            self.text += new
            # ids with no text (special ones) are no context: the next step keeps this one
            self.context, self.read = self.read if new else self.context, len(self.ids)
        return self.text


@functools.cache
def step_decoder(tokenizer):
    """decode(ids) -> text (special ids skipped) for decoding a step at a time, or None
    where decoding ids does not join their texts as they are: transformers'
    clean_up_tokenization_spaces (" ." -> ".", across ids), where it applies. A fast
    tokenizer's own decode, without transformers' wrapper around it (most of the time of
    a step's few ids)."""
    probe = "a ."
    if tokenizer.decode(tokenizer.encode(probe, add_special_tokens=False),
                        skip_special_tokens=True) != probe:
        return None
    # a class that decodes its own way (its own decode or _decode) keeps it
    plain = hasattr(tokenizer, "backend_tokenizer") and all(
        getattr(type(tokenizer), name) is getattr(PreTrainedTokenizerFast, name)
        for name in ("decode", "_decode"))
    decode = tokenizer.backend_tokenizer.decode if plain else tokenizer.decode
    return functools.partial(decode, skip_special_tokens=True)


class Request:
    """One server request: its prompts, each an engine request of n samples, and what each
    choice has so far."""

    def __init__(self, prompts, params, n, stop, emit, tokenizer, first_index=0,
                 stream=True):
        self.prompts, self.params, self.n, self.emit = prompts, params, n, emit
        # whether its samples report as they go: to stream, or to find the stop strings
        self.progress = stream or bool(stop)
        self.first_index = first_index   # seeded: prompt i draws as prompt first_index + i
        self.samples = [SampleText(tokenizer, stop) for _ in range(len(prompts) * n)]
        self.request_ids = []            # the engine's request_id of each prompt, once added


class EngineLoop:
    """The owner thread of an InferenceEngine. Every public method may be called
    from any thread."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.inbox = queue.Queue()
        # engine request_id -> (Request, prompt index), for requests still running
        self.by_request = {}
        # the most samples one step has run (continuous batching at work)
        self.peak_batch = 0
        # paused: the mode ('abort' | 'wait' | 'keep', else None), the requests that came in
        # since, and the pause('wait') calls waiting for the running samples to finish
        self.mode, self.queued, self.draining = None, [], []
        self.thread = threading.Thread(target=self._run, name="engine-owner", daemon=True)
        self.thread.start()

    # ---- called from other threads

    def submit(self, prompts, params, n, stop, emit, first_index=0, stream=True) -> Request:
        """Queue a request (prompts already checked against the engine's limits);
        emit(list[Delta]) is called from the owner thread, in order, until every sample
        has finished (or an error Delta); stream=False (and no stop strings): once per
        sample, when it ends."""
        request = Request(prompts, params, n, stop, emit, self.tokenizer, first_index, stream)
        self.inbox.put(("add", request))
        return request

    def abort(self, request):
        """Drop what is left of a request (its client went away): its samples stop and
        free their blocks."""
        self.inbox.put(("abort", request))

    def call(self, fn):
        """Run fn(engine) on the owner thread between two steps; returns its result (or
        raises its error)."""
        return self._ask("call", fn)

    def pause(self, mode, clear_cache=True):
        """Stop generating in mode 'abort', 'wait' or 'keep' (the module docstring);
        returns once paused: with 'wait', once nothing steps any more. With clear_cache
        the prefix cache is forgotten and (as vLLM's does) the kept samples are sent back
        to be recomputed: after resume() they prefill again with the weights in then, so
        each later token is exactly those weights' (without, they go on over the keys and
        values the old weights made). A resume() before a 'wait' completes fails it."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode={mode!r}: expected 'abort', 'wait' or 'keep'")
        self._ask("pause", (mode, clear_cache))

    def resume(self):
        """Generate again: the kept samples go on, the requests queued meanwhile start."""
        self._ask("resume", None)

    def paused(self):
        """Whether a pause was asked and not resumed (a 'wait' may still be stepping)."""
        return self.mode is not None

    def close(self):
        self.inbox.put(("stop", None))
        self.thread.join(timeout=30)

    def _ask(self, kind, payload):
        """Hand (kind, payload) to the owner thread and wait for its answer."""
        if not self.thread.is_alive():
            raise RuntimeError("the engine loop is closed")
        reply = queue.Queue(maxsize=1)
        self.inbox.put((kind, (payload, reply)))
        ok, value = reply.get()
        if not ok:
            raise value
        return value

    # ---- the owner thread

    def _stepping(self):
        return self.engine.has_pending() and self.mode != "keep"

    def _run(self):
        while True:
            if self.draining and not self._stepping():   # a 'wait' pause: nothing steps now
                for clear_cache, reply in self.draining:
                    self._answer(reply, self._finish_pause, clear_cache)
                self.draining = []
            if not self._take_messages(block=not self._stepping()):
                return
            if self._stepping():
                try:
                    self.peak_batch = max(self.peak_batch, len(self.engine.running))
                    finished = self.engine.step()
                except Exception as e:
                    # a bug, not bad input (that was refused at the door): end every request
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                    continue
                self._report(finished)

    def _take_messages(self, block):
        """Handle everything queued (waiting for the first message when block); False once
        told to stop."""
        handlers = {"call": lambda fn: fn(self.engine), "resume": self._resume}
        while True:
            try:
                kind, payload = self.inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                self._close()
                return False
            if kind == "add" and self.mode:   # paused: it waits for resume()
                self.queued.append(payload)
            elif kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._drop(payload)
            elif kind == "pause":
                self._pause(*payload)
            else:
                value, reply = payload
                self._answer(reply, handlers[kind], value)

    @staticmethod
    def _answer(reply, fn, value):
        """reply (ok, result) of fn(value), or (False, its error)."""
        try:
            reply.put((True, fn(value)))
        except Exception as e:
            reply.put((False, e))

    def _pause(self, mode_and_clear, reply):
        """Paused once nothing more steps: at once, or ('wait') once the running samples
        have finished (answered then, from _run)."""
        self.mode, clear_cache = mode_and_clear
        if self.mode == "wait" and self._stepping():
            self.draining.append((clear_cache, reply))
        else:
            self._answer(reply, self._finish_pause, clear_cache)

    def _finish_pause(self, clear_cache):
        if self.mode == "abort":
            self._abort_running()
        if clear_cache:
            self.engine.recompute_running()
            self.engine.flush_cache()

    def _resume(self, _):
        for clear_cache, reply in self.draining:
            reply.put((False, RuntimeError("resumed before the pause had completed")))
        self.mode, self.draining, queued, self.queued = None, [], self.queued, []
        for request in queued:
            self._add(request)

    def _close(self):
        """The owner's last act: every request (queued ones too) and every pause still
        waiting hears that the loop is shutting down."""
        self._fail_all("the server is shutting down")
        for request in self.queued:
            request.emit([Delta(-1, [], [], [], [], "", None, error="the server is shutting down")])
        for _, reply in self.draining:
            reply.put((False, RuntimeError("the engine loop closed before the pause completed")))
        self.queued, self.draining = [], []

    def _abort_running(self):
        """Every running sample ends now with what it has, finish reason 'abort' (a
        request that does not stream hears its tokens only now); so do requests queued
        while paused, with nothing."""
        out = {}
        for seq in self.engine.waiting + self.engine.running:
            if seq.request_id in self.by_request and seq.num_samples == 1:
                self._progress(out, seq.request_id, seq.sample_index, seq.tokens[seq.num_prompt:],
                               seq.logprobs, seq.top_logprobs, seq.versions, "abort")
        for request in {r for r, _ in self.by_request.values()} | set(self.queued):
            for index, sample in enumerate(request.samples):
                if sample.finish_reason is None:   # not sampled at all yet
                    sample.finish_reason = "abort"
                    out.setdefault(request, []).append(Delta(index, [], [], [], [], "", "abort"))
            self._drop(request)
        for request, deltas in out.items():
            request.emit(deltas)

    def _add(self, request):
        try:
            for i, prompt in enumerate(request.prompts):
                request_id = self.engine.add_request(prompt, request.params, request.n,
                                                     request.first_index + i)
                request.request_ids.append(request_id)
                self.by_request[request_id] = (request, i)
        except Exception as e:  # checked at the door, so not expected: refuse it whole
            self._drop(request)
            request.emit([Delta(-1, [], [], [], [], "", None, error=f"{type(e).__name__}: {e}")])

    def _report(self, finished):
        """One Delta per sample that moved in this step, sent per request."""
        out = {}
        for seq in self.engine.running:            # samples still going: their new tokens
            entry = self.by_request.get(seq.request_id)    # (request, prompt index)
            if entry and entry[0].progress and seq.num_samples == 1:
                self._progress(out, seq.request_id, seq.sample_index, seq.tokens[seq.num_prompt:],
                               seq.logprobs, seq.top_logprobs, seq.versions, None)
        for s in finished:  # samples that finished in this step: the rest of them
            if s.request_id in self.by_request:
                self._progress(out, s.request_id, s.sample_index, s.completion_tokens, s.logprobs,
                               s.top_logprobs, s.token_versions, s.finish_reason)
        for request, deltas in out.items():
            if all(t.finish_reason for t in request.samples):
                self._forget(request)
            request.emit(deltas)

    def _progress(self, out, request_id, sample_index, ids, logprobs, tops, versions,
                  finish_reason):
        request, p = self.by_request[request_id]
        index = p * request.n + sample_index
        sample = request.samples[index]
        k = len(sample.ids)
        if (len(ids) == k and finish_reason is None) or sample.finish_reason:
            return
        text, stopped = sample.add(list(ids[k:]), final=finish_reason is not None)
        # a stop string: this sample ends here, in the engine too
        if stopped and finish_reason is None:
            self.engine.abort(request_id, sample_index)
        sample.finish_reason = "stop" if stopped else finish_reason
        out.setdefault(request,
                       []).append(Delta(index, list(ids[k:]), list(logprobs[k:]), list(tops[k:]),
                                        list(versions[k:]), text, sample.finish_reason))

    def _drop(self, request):
        if request in self.queued:   # came in while paused, never started
            self.queued.remove(request)
        for request_id in request.request_ids:
            self.engine.abort(request_id)
        self._forget(request)

    def _forget(self, request):
        for request_id in request.request_ids:
            self.by_request.pop(request_id, None)

    def _fail_all(self, message):
        for request in {r for r, _ in self.by_request.values()}:
            self._drop(request)
            request.emit([Delta(-1, [], [], [], [], "", None, error=message)])
