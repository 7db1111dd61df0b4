"""
The client side of serve.py: training samples rebuilt from the server's responses, token for token.

    from openai import OpenAI
    api = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")
    extra = {"return_token_ids": True}
    r1 = api.chat.completions.create(model=name, messages=msgs, logprobs=True, extra_body=extra)
    s1 = sample_from_response(r1)           # a TrainingSample: the very ids sampled, their logprobs
    ids = next_turn_prompt(tokenizer, s1, msgs, [{"role": "user", "content": "and then?"}])
    r2 = api.completions.create(model=name, prompt=ids, logprobs=0, max_tokens=64, extra_body=extra)
    s2 = sample_from_response(r2)       # its prompt is turn 1 exactly as sampled, then the new turn

Why by ids: text that goes back through a tokenizer may come out as other ids ("user" as one token
or four), and a chat template may render earlier turns differently from how they were sampled.
Either way the trainer would score a sequence the model never produced. So the next prompt is the
previous prompt + the sampled ids + the template's own ids for the new message, and it is checked
against the template's rendering of the same conversation: a difference raises, naming the first
position where the two disagree.
"""

from engine import TrainingSample


def as_dict(response):
    """An openai client object (pydantic) or a plain dict, as a dict (extra fields such as token_ids
    kept)."""
    return response.model_dump() if hasattr(response, "model_dump") else response


def sample_from_response(response, index=0, sent=None) -> TrainingSample:
    """The TrainingSample of choice `index` of a chat or completion response made with
    return_token_ids=true and logprobs on (chat: logprobs=true; completions: logprobs=0 or more).
    sent: the prompt ids the request sent, if it sent ids; the server's prompt_token_ids must be
    exactly those."""
    r = as_dict(response)
    choice = r["choices"][index]
    chat = "message" in choice
    prompt = r.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
    ids, logprobs = choice.get("token_ids"), choice.get("logprobs")
    if prompt is None or ids is None:
        raise ValueError("the response has no prompt_token_ids / token_ids: send "
                         "return_token_ids=true")
    if sent is not None:
        check_same(list(prompt), list(sent), None,
                   "the server's prompt_token_ids against the ids sent")
    if logprobs is None:
        raise ValueError("the response has no logprobs: send logprobs=true (chat) or logprobs=0 "
                         "(completions)")
    logprobs = [c["logprob"] for c in logprobs["content"]] if chat else logprobs["token_logprobs"]
    if len(logprobs) != len(ids):
        raise ValueError(f"choice {index} has {len(ids)} token ids but {len(logprobs)} logprobs")
    if choice["finish_reason"] not in ("stop", "length"):
        raise ValueError(f"choice {index} finished with {choice['finish_reason']!r}, expected "
                         f"'stop' or 'length'")
    return TrainingSample(prompt_tokens=tuple(prompt), completion_tokens=tuple(ids),
                          logprobs=tuple(logprobs), weight_version=choice.get("weight_version", 0),
                          finish_reason=choice["finish_reason"], sample_index=index)


def chat_ids(tokenizer, messages, add_generation_prompt):
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False)
    return [int(t) for t in (out["input_ids"] if isinstance(out, dict) else out)]


def first_difference(a, b):
    """The first position where the id lists a and b differ (one ending early counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_same(ours, expected, tokenizer, what):
    """Raise a ValueError naming the first position where the ids ours and expected differ."""
    i = first_difference(ours, expected)
    if i is not None:
        def around(ids):
            part = ids[max(i - 3, 0):i + 3]
            return f"{part} ({tokenizer.decode(part)!r})" if tokenizer is not None else f"{part}"
        raise ValueError(f"{what}: the ids differ at position {i}: ours {around(ours)}, expected "
                         f"{around(expected)}")


def next_turn_prompt(tokenizer, sample, messages, new_messages) -> list[int]:
    """The prompt ids of the next turn: sample's prompt + its sampled ids + the template's ids that
    close the assistant turn (those after the reply: "\n" after a sampled <|im_end|>, or
    "<|im_end|>\n" after a reply cut off at max_tokens) + the template's ids for new_messages and
    the generation prompt. messages is the conversation sample's prompt was made from. Checked:
    sample's prompt is the template's rendering of messages, and the result is the template's
    rendering of the whole conversation (the reply as its decoded text), so a reply whose ids the
    tokenizer would not give back raises, at the first differing position. The new prompt starts
    with everything before it by construction; sample_from_response(..., sent=ids) checks the server
    kept it so."""
    prompt, sampled = list(sample.prompt_tokens), list(sample.completion_tokens)
    check_same(prompt, chat_ids(tokenizer, messages, True), tokenizer, "the sample's prompt")
    reply = {"role": "assistant", "content": tokenizer.decode(sampled, skip_special_tokens=True)}
    # ... <|im_start|>assistant\nREPLY<|im_end|>\n
    so_far = chat_ids(tokenizer, list(messages) + [reply], False)
    whole = chat_ids(tokenizer, list(messages) + [reply] + list(new_messages), True)
    check_same(whole[:len(so_far)], so_far, tokenizer, "the chat template is not prefix-stable")
    ids = prompt + sampled + so_far[len(prompt) + len(sampled):] + whole[len(so_far):]
    check_same(ids, whole, tokenizer, "the continued conversation against the chat template")
    return ids
