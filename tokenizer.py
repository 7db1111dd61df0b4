"""
The embedded default's own tokenizer: a tiny, fixed vocabulary built with HF `tokenizers`, no
downloads.

Every character of printable ASCII (plus newline) is one token, a handful of words that every prompt
repeats ("user", "assistant", "digits", ...) are one token each so prompts stay short, and the three
ChatML special tokens of Qwen sit at the front. The result is wrapped as a transformers tokenizer
with a Qwen-style ChatML chat template, so the rest of the stack treats it exactly like a hub
tokenizer:

    <|im_start|>user\ndigits 3 5 7 target 22<|im_end|>\n<|im_start|>assistant\n3*5+7<|im_end|>\n

eos for chat is <|im_end|> (the engine's stop token); pad and the pretraining document separator is
<|endoftext|>. The vocabulary is a literal list below, so ids are the same on every run and every
machine.
"""

import json
import os
import shutil
import tempfile
from collections.abc import Mapping

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

# -----------------------------------------------------------------------------
# the vocabulary (order is the id assignment; append only, never reorder)

ENDOFTEXT = "<|endoftext|>"  # pad, and separator between pretraining documents
IM_START = "<|im_start|>"
# end of a chat turn: the eos the model learns to emit and the engine stops on
IM_END = "<|im_end|>"
UNK = "<|unk|>"  # any character outside the vocabulary (never produced by the task)
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, UNK]

# whole words that every conversation repeats: one token each instead of 4-9 characters
WORDS = ["user", "assistant", "system", "digits", "target"]

CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # newline + printable ASCII (space .. ~)

VOCAB = SPECIAL_TOKENS + CHARS + WORDS  # 4 + 96 + 5 = 105 ids
GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")   # no class of its own

# Qwen-style ChatML. No default system prompt (the task's prompts are short on purpose). An
# assistant turn is "<|im_start|>assistant\n" + content + "<|im_end|>" + "\n"; add_generation_prompt
# appends the header only.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# -----------------------------------------------------------------------------
# build / save / load


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer, built from the literal vocabulary above (deterministic ids, no files, no
    network)."""
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    assert len(vocab) == len(VOCAB), "duplicate vocabulary entry"
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # each piece is either one of WORDS or a single character; WordLevel then maps pieces to ids one
    # to one. [\s\S] is any character, newline included. The words come first so the regex prefers
    # them over letters.
    pattern = "|".join(WORDS) + r"|[\s\S]"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate the pieces back, no spaces inserted
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=None, eos_token=IM_END,
                                  pad_token=ENDOFTEXT, unk_token=UNK,
                                  additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False, model_max_length=4096)
    # the specials must keep the ids of VOCAB (add_special_tokens must not have appended new ones)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.convert_tokens_to_ids(s) != i:
            raise RuntimeError(f"special token {s!r} got id {tok.convert_tokens_to_ids(s)}, "
                               f"expected {i}")
    if len(tok) != len(VOCAB):
        raise RuntimeError(f"tokenizer has {len(tok)} ids, expected {len(VOCAB)}")
    return tok


def save_tokenizer(tok, path) -> None:
    """Write tok to the directory path: into a temp dir first, then renamed into place (the whole
    dir if new, file by file into an existing one, e.g. a checkpoint dir, whose other files are
    kept)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"tokenizer path exists and is not a directory: {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    try:
        tok.save_pretrained(tmp)
        if os.path.isdir(path):  # keep other files of a checkpoint dir: move ours in one by one
            for name in os.listdir(tmp):
                os.replace(os.path.join(tmp, name), os.path.join(path, name))
        else:
            os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _named_class(path):
    """The tokenizer_class that path's tokenizer_config.json names, or None."""
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        return json.load(f).get("tokenizer_class")


def load_tokenizer(path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by save_tokenizer (or any local HF tokenizer dir): with AutoTokenizer
    when its tokenizer_config.json names a class of its own (Qwen2Tokenizer, ...), else as what
    tokenizer.json says. AutoTokenizer would pick the class of the model_type in a config.json
    beside ours (Qwen2Tokenizer, say), which rebuilds the pre-tokenizer and loses our spaces."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path!r}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in tokenizer directory {path!r}")
    try:
        loader = AutoTokenizer if _named_class(path) not in GENERIC_CLASSES else \
            PreTrainedTokenizerFast
        tok = loader.from_pretrained(path, local_files_only=True)
    except Exception as e:
        # json errors, OSError, and the Rust side's plain Exception all mean the same here
        raise ValueError(f"corrupt tokenizer directory {path!r}: {type(e).__name__}: {e}") from e
    if tok.chat_template is None:
        raise ValueError(f"tokenizer in {path!r} has no chat_template")
    return tok


# -----------------------------------------------------------------------------
# chat helpers: the only way prompt ids and training examples are made, so the two always agree


def _ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True) unless
    # return_dict=False; accept either so a version change cannot silently hand a dict to the engine
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    ids = [int(i) for i in out]
    return ids


def _check_messages(tok, messages) -> None:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got "
                         f"{messages!r}")
    specials = set(tok.all_special_tokens)
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"),
                                                        str) or not isinstance(m.get("content"),
                                                                               str):
            raise TypeError(f"each message must be a dict with str 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"unknown chat role {m['role']!r} (expected system, user or "
                             f"assistant)")
        for s in specials:
            if s in m["content"]:
                raise ValueError(f"message content contains the special token {s!r}: "
                                 f"{m['content']!r}")


def chat_prompt_ids(tok, messages) -> list[int]:
    """Token ids of messages followed by the assistant header: what the engine is asked to
    continue."""
    _check_messages(tok, messages)
    return _ids(tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def generation_stop_ids(tok) -> list[int]:
    """What ends a generation: the eos (<|im_end|>, a chat turn's end) and, when the vocabulary has
    it, the document separator <|endoftext|> (a plain completion's end), as Qwen's generation_config
    lists them."""
    ids = [tok.eos_token_id,
           tok.convert_tokens_to_ids(ENDOFTEXT) if ENDOFTEXT in tok.get_vocab() else None]
    return [i for i in dict.fromkeys(ids) if i is not None]


def completion_text(tok, ids) -> str:
    """What the reward reads: the completion's text with its special tokens kept. Skipping them
    would let '3*<|im_start|>5+7' pass as '3*5+7'; task.reward drops the closing <|im_end|>
    itself."""
    return tok.decode(ids, skip_special_tokens=False)


def chat_example(tok, messages) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a whole conversation whose last message is the assistant reply to learn.

    The mask is 1 exactly on the reply's tokens and its closing <|im_end|> (so the model learns to
    stop), 0 on everything before and on the template's trailing newline. The prompt part is the
    very ids chat_prompt_ids gives for messages[:-1]; that is checked, not assumed.
    """
    _check_messages(tok, messages)
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"the last message must be the assistant reply, got role "
                         f"{messages[-1]['role']!r}")
    reply = messages[-1]["content"]
    full = _ids(tok.apply_chat_template(list(messages), tokenize=True, return_dict=False))
    if len(messages) > 1:
        prompt = chat_prompt_ids(tok, messages[:-1])
    else:  # a reply with no context: the prompt is just the assistant header
        prompt = _ids(tok.encode(IM_START + "assistant\n", add_special_tokens=False))
    if full[: len(prompt)] != prompt:
        raise RuntimeError("chat template is not prefix-stable: prompt ids are not a prefix of the "
                           "full ids")
    # the reply ends at the last <|im_end|>; what follows it is template trailer ("\n"), not
    # to be learned
    im_end = tok.convert_tokens_to_ids(IM_END)
    end = max(i for i, t in enumerate(full) if t == im_end) + 1
    if end <= len(prompt):
        raise RuntimeError("no <|im_end|> after the prompt: the template did not close the "
                           "assistant turn")
    mask = [0] * len(prompt) + [1] * (end - len(prompt)) + [0] * (len(full) - end)
    # the learned tokens must be exactly the reply text then <|im_end|> (catches unknown characters
    # -> <|unk|>)
    learned = tok.decode(full[len(prompt):end], skip_special_tokens=False)
    if learned != reply + IM_END:
        raise ValueError(f"reply does not round-trip through the tokenizer: {reply!r} -> "
                         f"{learned!r}")
    return full, mask
