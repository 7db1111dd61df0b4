"""
The embedded default's own tokenizer: a tiny, fixed vocabulary built with HF
`tokenizers`, no downloads.

Every character of printable ASCII (plus newline) is one token, a handful of words that
every prompt repeats ("user", "assistant", "digits", ...) are one token each so prompts
stay short, and the three ChatML special tokens of Qwen sit at the front. The result is
wrapped as a transformers tokenizer with a Qwen-style ChatML chat template, so the rest
of the stack treats it exactly like a hub tokenizer:

    <|im_start|>user\ndigits 3 5 7 target 22<|im_end|>\n<|im_start|>assistant\n3*5+7<|im_end|>\n

eos for chat is <|im_end|> (the engine's stop token); pad and the pretraining document
separator is <|endoftext|>. The vocabulary is a literal list below, so ids are the same
on every run and every machine.
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
THINK_START, THINK_END = "<think>", "</think>"   # a thinking template's reasoning block (Qwen3)
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, UNK]

# whole words that every conversation repeats: one token each instead of 4-9 characters
WORDS = ["user", "assistant", "system", "digits", "target"]

CHARS = ["\n"] + [chr(c) for c in range(32, 127)]  # newline + printable ASCII (space .. ~)

VOCAB = SPECIAL_TOKENS + CHARS + WORDS  # 4 + 96 + 5 = 105 ids
GENERIC_CLASSES = (None, "TokenizersBackend", "PreTrainedTokenizerFast")   # no class of its own

# Qwen-style ChatML. No default system prompt (the task's prompts are short on purpose).
# An assistant turn is "<|im_start|>assistant\n" + content + "<|im_end|>" + "\n";
# add_generation_prompt appends the header only.
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
    """The tokenizer, built from the literal vocabulary above (deterministic ids, no
    files, no network)."""
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # each piece is either one of WORDS or a single character; WordLevel then maps pieces
    # to ids one to one. [\s\S] is any character, newline included. The words come first
    # so the regex prefers them over letters.
    pattern = "|".join(WORDS) + r"|[\s\S]"
    core.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    core.decoder = decoders.Fuse()  # concatenate the pieces back, no spaces inserted
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token=None, eos_token=IM_END,
                                  pad_token=ENDOFTEXT, unk_token=UNK,
                                  additional_special_tokens=[IM_START], chat_template=CHAT_TEMPLATE,
                                  clean_up_tokenization_spaces=False, model_max_length=4096)
    # the specials must keep the ids of VOCAB (add_special_tokens must not have
    # appended new ones)
    specials = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert specials == list(range(len(SPECIAL_TOKENS))) and len(tok) == len(VOCAB), specials
    return tok


def save_tokenizer(tok, path) -> None:
    """Write tok to the directory path: into a temp dir first, then renamed into place
    (the whole dir if new, file by file into an existing one, e.g. a checkpoint dir,
    whose other files are kept)."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"tokenizer path exists and is not a directory: {path!r}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tokenizer-", dir=parent)
    try:
        tok.save_pretrained(tmp)
        if os.path.isdir(path):
            # keep other files of a checkpoint dir: move ours in one by one
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
    """Load a tokenizer saved by save_tokenizer (or any local HF tokenizer dir): with
    AutoTokenizer when its tokenizer_config.json names a class of its own
    (Qwen2Tokenizer, ...), else as what tokenizer.json says. AutoTokenizer would pick
    the class of the model_type in a config.json beside ours (Qwen2Tokenizer, say),
    which rebuilds the pre-tokenizer and loses our spaces."""
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}")
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
# chat helpers: the only way prompt ids and training examples are made, so the
# two always agree


def _ids(out) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    # unless return_dict=False; accept either so a version change cannot silently hand a
    # dict to the engine
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    ids = [int(i) for i in out]
    return ids


def _check_messages(tok, messages) -> None:
    if not isinstance(messages, (list, tuple)) or len(messages) == 0:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    specials = set(tok.all_special_tokens)
    for m in messages:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise TypeError(f"each message must be a dict with str 'role' and 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant"):
            raise ValueError(f"unknown chat role {m['role']!r} (system, user, assistant)")
        for s in specials:
            if s in m["content"]:
                raise ValueError(f"a message has the special token {s!r}: {m['content']!r}")


def chat_ids(tok, messages, add_generation_prompt, **template_kwargs) -> list[int]:
    """The chat template's ids of messages (unchecked: the callers check them). A template
    that raises on them (an unknown role, turns out of order, ...) is refused with a
    ValueError that names its failure."""
    try:
        out = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                      tokenize=True, return_dict=False, **template_kwargs)
    except Exception as e:   # jinja's TemplateError, the template's raise_exception, ...
        roles = [m.get("role") for m in messages]
        raise ValueError(f"the chat template cannot render roles {roles}: {e!r}") from e
    return _ids(out)


# what a caller's template_kwargs may not set: the rendering's own inputs, and what this
# stack does not render (tools, documents)
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "add_generation_prompt", "continue_final_message", "tools", "custom_tools",
    "documents", "raise_exception", "strftime_now", "bos_token", "eos_token", "pad_token",
    "unk_token"})


def check_template_kwargs(tok, kwargs, name="chat_template_kwargs") -> dict:
    """kwargs for the chat template (Qwen3's {"enable_thinking": false}), refused with a
    ValueError naming the key unless it is a variable the template reads and does not
    overwrite (it may set a default when the variable `is not defined`, as Llama 3's
    date_string): a key it ignores or overwrites would be honoured silently by nothing."""
    import jinja2.meta   # transformers renders chat templates with jinja2
    if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ValueError(f"{name} must be a dict with string keys, got {kwargs!r}")
    tree = jinja2.Environment().parse(tok.chat_template)
    set_here = {n.name for n in tree.find_all(jinja2.nodes.Name) if n.ctx == "store"}
    defaults = {t.node.name for t in tree.find_all(jinja2.nodes.Test)
                if t.name == "defined" and isinstance(t.node, jinja2.nodes.Name)}
    used = jinja2.meta.find_undeclared_variables(tree) - (set_here - defaults)
    honoured = sorted(used - RESERVED_TEMPLATE_NAMES)
    for key in kwargs:
        if key not in honoured:
            raise ValueError(f"{name}: the chat template reads {honoured or 'none'}, not {key!r}")
    return dict(kwargs)


def chat_prompt_ids(tok, messages, **template_kwargs) -> list[int]:
    """Token ids of messages followed by the assistant header: what the engine is asked to
    continue. template_kwargs go to the template (Qwen3's enable_thinking=False, ...)."""
    _check_messages(tok, messages)
    return chat_ids(tok, messages, True, **template_kwargs)


def chat_prompt_ids_batch(tok, conversations, **template_kwargs) -> list[list[int]]:
    """chat_prompt_ids of each conversation, rendered in one call: the tokenizer's batch
    path, over thousands of prompts a few times faster (the engine is sized over every
    training prompt when a run starts). A conversation the template refuses is named by
    rendering them one at a time."""
    for messages in conversations:
        _check_messages(tok, messages)
    if not conversations:
        return []
    try:
        out = tok.apply_chat_template([list(m) for m in conversations],
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False, **template_kwargs)
    except Exception:   # the one-at-a-time path raises the ValueError that names it
        return [chat_prompt_ids(tok, m, **template_kwargs) for m in conversations]
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [_ids(ids) for ids in out]


def generation_stop_ids(tok) -> list[int]:
    """What ends a generation when no generation_config.json says (checkpoint.stop_ids_of
    reads it): the eos (<|im_end|>, a chat turn's end) and, when the vocabulary has it,
    the document separator <|endoftext|> (a plain completion's end), as Qwen's
    generation_config lists them."""
    ids = [tok.eos_token_id,
           tok.convert_tokens_to_ids(ENDOFTEXT) if ENDOFTEXT in tok.get_vocab() else None]
    return [i for i in dict.fromkeys(ids) if i is not None]


def completion_text(tok, ids) -> str:
    """What the reward reads: the completion's text with its special tokens kept.
    Skipping them would let '3*<|im_start|>5+7' pass as '3*5+7'; task.reward drops the
    closing <|im_end|> itself."""
    return tok.decode(ids, skip_special_tokens=False)


def reply_parts(tok, text) -> tuple[str | None, str]:
    """(reasoning, content) of a reply's text. A template with a </think> token
    (Qwen3's) has the model think first: "<think>\nplan\n</think>\n\n42" -> ("plan",
    "42"). Without that token, or a </think> in the text, the whole text is content:
    (None, text)."""
    think_end = tok.convert_tokens_to_ids(THINK_END)
    if think_end is None or think_end == tok.unk_token_id or THINK_END not in text:
        return None, text
    reasoning, content = text.split(THINK_END, 1)
    return reasoning.split(THINK_START)[-1].strip("\n"), content.lstrip("\n")


def chat_example(tok, messages, stop_ids=None, **template_kwargs) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) of a whole conversation whose last message is the assistant
    reply to learn.

    The mask covers exactly what the model would sample for that turn: the template's
    ids after the generation prompt up to and including the first stop id (stop_ids,
    default generation_stop_ids), so the model learns to stop. That is the reply then
    <|im_end|> in ChatML, an (empty) think block, the reply and <|im_end|> in Qwen3's,
    the reply and <|eot_id|> in Llama 3's. Everything before is 0, and so is what the
    template writes after the stop (ChatML's newline). The prompt is the very ids
    chat_prompt_ids gives for messages[:-1]; that is checked, not assumed.
    """
    _check_messages(tok, messages)
    if messages[-1]["role"] != "assistant" or len(messages) < 2:
        raise ValueError(f"a demonstration ends with the assistant reply to learn, after at least "
                         f"one message; got roles {[m['role'] for m in messages]}")
    stop = set(generation_stop_ids(tok) if stop_ids is None else stop_ids)
    prompt = chat_prompt_ids(tok, messages[:-1], **template_kwargs)
    full = chat_ids(tok, messages, False, **template_kwargs)
    # otherwise the model would be taught a turn it never samples
    if full[:len(prompt)] != prompt:
        raise ValueError("the chat template renders the reply after other ids than its prompt's")
    end = next((i + 1 for i in range(len(prompt), len(full)) if full[i] in stop), None)
    if end is None:
        raise ValueError(f"the chat template ends a reply with none of the stop ids {sorted(stop)}")
    # the learned text must end with the reply (catches characters the tokenizer cannot
    # spell -> <|unk|>; the template may trim the reply, or write a think block before it)
    learned = tok.decode(full[len(prompt):end - 1], skip_special_tokens=False)
    reply = messages[-1]["content"]
    if not learned.strip().endswith(reply.strip()):
        raise ValueError(f"reply does not round-trip: {reply!r} -> {learned!r}")
    mask = [0] * len(prompt) + [1] * (end - len(prompt)) + [0] * (len(full) - end)
    return full, mask


# a conversation whose assistant turn is empty: what the template writes around any turn
STUB = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]


class TurnBridge:
    """The ids between one reply and the next, rendered by the template on a stub
    conversation, so an episode grows by ids and earlier replies are never re-rendered
    (the training sequence is the sampling sequence, for any template, including
    Qwen3's, which renders earlier turns without their think blocks). E.g. ChatML, after
    a reply that stopped on <|im_end|>:

        \n <|im_start|>user\n= 22, target 23<|im_end|>\n <|im_start|>assistant\n

    close: the template's ids from the first stop id after an assistant turn's header to
    the end of the turn (ChatML: <|im_end|> \n; Llama 3: <|eot_id|>). A reply that
    stopped on any stop id has closed its turn with it (as the renderers package's
    bridges treat <|endoftext|> or <|eom_id|>), so the rest follows; one cut at
    max_tokens gets all of them."""

    def __init__(self, tok, stop_ids, **template_kwargs):
        self.tok, self.stop, self.kwargs = tok, frozenset(stop_ids), template_kwargs
        self.opened = chat_prompt_ids(tok, STUB[:1], **template_kwargs)
        closed = chat_ids(tok, STUB, False, **template_kwargs)
        at = next((i for i in range(len(self.opened), len(closed)) if closed[i] in self.stop), None)
        if closed[:len(self.opened)] != self.opened or at is None:
            raise ValueError(f"no episodes by ids: the chat template's assistant turn is not its "
                             f"generation prompt, a reply and a stop id of {sorted(self.stop)}")
        self.close = closed[at:]
        # where the stub's assistant turn starts
        self.user = chat_ids(tok, STUB[:1], False, **template_kwargs)

    def next_ids(self, new_messages, last_id) -> list[int]:
        """The ids after a reply whose last id is last_id: the rest of its turn's close,
        the new messages as the template renders them after an assistant turn, the
        generation prompt. Found in the template's rendering of STUB + new_messages:
        what follows the stub reply's close."""
        _check_messages(self.tok, new_messages)
        whole = chat_ids(self.tok, STUB + list(new_messages), True, **self.kwargs)
        n = len(self.close)
        at = next((i for i in range(len(self.user), len(whole) - n + 1)
                   if whole[i:i + n] == self.close), None)
        if whole[:len(self.user)] != self.user or at is None:
            raise ValueError("no episodes by ids: the chat template renders an assistant turn "
                             "before more messages unlike one that ends the conversation")
        rest = self.close[1:] if last_id in self.stop else self.close
        return rest + whole[at + n:]
