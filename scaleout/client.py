"""
The client side of scaleout/serve.py: training samples rebuilt from the server's
responses, token for token.

    from openai import OpenAI
    api = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    extra = {"return_token_ids": True}
    r1 = api.chat.completions.create(model=name, messages=msgs, logprobs=True, extra_body=extra)
    s1 = sample_from_response(r1)           # a TrainingSample: the very ids sampled, their logprobs
    ids = next_turn_prompt(tokenizer, s1, [{"role": "user", "content": "and then?"}])
    r2 = api.completions.create(model=name, prompt=ids, logprobs=0, max_tokens=64, extra_body=extra)
    s2 = sample_from_response(r2)       # its prompt is turn 1 exactly as sampled, then the new turn

Why by ids: text that goes back through a tokenizer may come out as other ids ("user" as
one token or four), and a chat template may render earlier turns differently from how
they were sampled (Qwen3's drops their think blocks). Either way the trainer would score
a sequence the model never produced. So the next prompt is the previous prompt + the
sampled ids + the template's own ids for the new messages (tokenizer.TurnBridge, as
tasks/environment.py builds its episodes), never a re-rendered history.
"""

from engine import TrainingSample
from tokenizer import TurnBridge, generation_stop_ids


def as_dict(response):
    """An openai client object (pydantic) or a plain dict, as a dict (extra fields such
    as token_ids kept)."""
    return response.model_dump() if hasattr(response, "model_dump") else response


def sample_from_response(response, index=0, sent=None) -> TrainingSample:
    """The TrainingSample of choice `index` of a chat or completion response made with
    return_token_ids=true and logprobs on (chat: logprobs=true; completions: logprobs=0
    or more). sent: the prompt ids the request sent, if it sent ids; the server's
    prompt_token_ids must be exactly those."""
    r = as_dict(response)
    choice = r["choices"][index]
    chat = "message" in choice
    prompt = r.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
    ids, logprobs = choice.get("token_ids"), choice.get("logprobs")
    if prompt is None or ids is None:
        raise ValueError("the response has no token ids: send return_token_ids=true")
    if sent is not None:
        check_same(list(prompt), list(sent), None,
                   "the server's prompt_token_ids against the ids sent")
    if logprobs is None:
        raise ValueError("no logprobs: send logprobs=true (chat) or logprobs=0 (completions)")
    logprobs = [c["logprob"] for c in logprobs["content"]] if chat else logprobs["token_logprobs"]
    if len(logprobs) != len(ids):
        raise ValueError(f"choice {index} has {len(ids)} token ids but {len(logprobs)} logprobs")
    finish = choice["finish_reason"]
    if finish not in ("stop", "length"):
        raise ValueError(f"choice {index} finished with {finish!r}, expected 'stop' or 'length'")
    return TrainingSample(prompt_tokens=tuple(prompt), completion_tokens=tuple(ids),
                          logprobs=tuple(logprobs), weight_version=choice.get("weight_version", 0),
                          finish_reason=finish, sample_index=index)


def first_difference(a, b):
    """The first position where the id lists a and b differ (one ending early
    counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_same(ours, expected, tokenizer, what):
    """Raise a ValueError naming the first position where the ids ours and expected
    differ."""
    i = first_difference(ours, expected)
    if i is not None:
        def around(ids):
            part = ids[max(i - 3, 0):i + 3]
            return f"{part} ({tokenizer.decode(part)!r})" if tokenizer is not None else f"{part}"
        raise ValueError(f"{what}: ids differ at {i}: {around(ours)}, not {around(expected)}")


def next_turn_prompt(tokenizer, sample, new_messages, stop_ids=None, **template_kwargs):
    """The prompt ids of the next turn: sample's prompt + its sampled ids + the template's
    ids that close the assistant turn (those after the stop id: "\n" after a sampled
    <|im_end|>; all of them, "<|im_end|>\n", after a reply cut off at max_tokens) + the
    template's ids for new_messages and the generation prompt. stop_ids: what the server
    stops on (/v1/models lists them; default the tokenizer's); template_kwargs: those
    the conversation was rendered with (enable_thinking=False, ...). The new prompt
    starts with everything before it by construction; sample_from_response(...,
    sent=ids) checks the server kept it so."""
    stop = generation_stop_ids(tokenizer) if stop_ids is None else stop_ids
    prompt, sampled = list(sample.prompt_tokens), list(sample.completion_tokens)
    bridge = TurnBridge(tokenizer, stop, **template_kwargs)
    return prompt + sampled + bridge.next_ids(new_messages,
                                              sampled[-1] if sampled else None)
