#!/usr/bin/env python3
"""Reference values from Hugging Face transformers for oomfix's chat-data parity tests.

Writes, under tests/fixtures/chat (or the directory given), from fixed seeds:

model/
    A tiny Llama-style causal LM (hidden 32, 2 layers, 4 heads, 2 key/value
    heads, head size 8, intermediate 64, 512 positions, RoPE base 10000,
    untied head), saved by save_pretrained in float32 (model.safetensors,
    config.json, generation_config.json). Its weights are random: every
    matrix drawn from N(0, 0.2²) and every norm scale from N(1, 0.1²)
    (rather than the default initialisation's N(0, 0.02²), under which every
    token's loss is close to ln V whatever its position, and a mask shifted
    by one would hardly change a loss).
    Beside it, the tokenizer as the tokenizer's save_pretrained writes it
    (tokenizer.json, tokenizer_config.json, chat_template.jinja): a
    byte-level BPE (all 256 bytes, 384 entries in all) trained with the
    tokenizers library on the text in TOKENIZER_TEXT below, with the special
    tokens <|endoftext|> (0, the padding token), <|im_start|> (1) and
    <|im_end|> (2, the end-of-sequence token); no beginning-of-sequence
    token, and nothing added to an encoding (tok("x").input_ids is
    tok("x", add_special_tokens=False).input_ids). The model's vocab_size is
    len(tokenizer) and its eos/pad ids the tokenizer's. tokenizer_config.json
    also carries the chat template as "chat_template" (the same text as
    chat_template.jinja): the ChatML template of SmolLM2-Instruct / Qwen2.5,
    which adds a default system message ("You are a helpful assistant.")
    when the first message is not a system one and trims each content.

messages.jsonl, messages.json, messages.parquet
    {"messages": [{"role", "content"}, ...]} rows (the second file: the same
    rows as one JSON array; the third, as Parquet written by pyarrow with
    snappy compression, as the Hub's datasets are): with and without a system message, several
    turns with two assistant messages, a content with leading and trailing
    whitespace.
prompt_completion.jsonl
    Conversational rows {"prompt": [messages], "completion": [one assistant
    message]}.
prompt_completion_text.jsonl
    Standard rows {"prompt": "...", "completion": "..."} of plain strings.
alpaca.jsonl
    {"instruction", "input", "output"} rows, one with an empty input. Read
    as conversational prompt/completion: prompt = one user message whose
    content is `instruction` when `input` is empty, else
    `instruction + "\\n\\n" + input`; completion = one assistant message with
    `output`.

reference.json
    For each data file (key: the file name), a list of its examples, each:
      input_ids: the example's token ids:
        messages: tok(tok.apply_chat_template(messages, tokenize=False),
                      add_special_tokens=False).input_ids;
        conversational prompt/completion (and alpaca): the same for the
                      messages prompt + completion;
        plain strings: tok(prompt + completion, add_special_tokens=False)
                      followed by the end-of-sequence id (as TRL appends
                      eos to a standard completion).
      completion_mask: 0/1 for each id:
        messages: for each assistant message i, 1 from the length of the ids
                      of messages[:i] rendered with add_generation_prompt=True
                      to the length of the ids of messages[:i + 1] rendered;
        conversational prompt/completion: 1 from the length of the ids of the
                      prompt rendered with add_generation_prompt=True to the end;
        plain strings: 1 from len(tok(prompt).input_ids) to the end (the eos
                      included).
        Each such prefix's ids are asserted to be a prefix of the whole ids.
      loss_sum_completions, tokens_completions: the sum of the cross-entropy
        of the next-token predictions (the logits at t predicting
        input_ids[t + 1]) over the targets t + 1 whose completion_mask is 1,
        and their number; the model run in float32 on the example alone
        (a batch of one, no padding), the sum taken by
        cross_entropy(reduction="sum") in float32 and stored as a float;
      loss_sum_all, tokens_all: the same over every target t + 1 >= 1.
    At the top level:
      loss_completions, loss_all: for each data file, the sum of its
        examples' loss_sum_completions (loss_sum_all) over the sum of their
        tokens_completions (tokens_all): the evaluation loss over the whole
        file, each example computed on its own;
      rendered: the rendered text of each example of messages.jsonl;
      generation_prompt_rendered: the first example's messages[:1] rendered
        with add_generation_prompt=True;
      vocab_size, eos_token_id, pad_token_id, versions.
    The reference is computed from the files as written, reloaded by
    AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained.

Runs on PyTorch CPU with transformers, tokenizers, safetensors, jinja2 and pyarrow
from PyPI (written with torch 2.15.0, transformers 5.25.0, tokenizers
0.23.3, safetensors 0.8.0, jinja2 3.1.6, pyarrow 26.0.1). Every run with the same versions on
the same machine writes the same files; on another CPU the losses may differ
in their last bits.

Usage: python scripts/make-chat-fixtures.py [FIXTURES_DIR]   (default: tests/fixtures/chat)
"""

import json
import os
import shutil
import sys

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast)

VOCAB = 384
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL = [PAD, IM_START, IM_END]  # ids 0, 1, 2

# SmolLM2-Instruct / Qwen2.5's ChatML template (a raw string: the template's
# text holds the two characters \n inside its string literals, as the Hub's
# tokenizer_config.json files do).
CHAT_TEMPLATE = (
    r"{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    r"{{'<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n'}}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOKENIZER_TEXT = """\
The assistant answers the user's questions in short, clear sentences. When the user
asks for help, the assistant explains what to do, one step at a time, and then stops.
A helpful assistant does not guess: if the question is not clear, it asks the user
what they mean.

The capital of France is Paris, and the capital of Italy is Rome. The river that runs
through London is the Thames. The sky is blue on a clear day and grey when it rains.
Grass is green, snow is white, and the sun is a star like many others in the night sky.

To make a cup of tea, boil some water, put a tea bag in a cup, pour the water over it
and wait for three or four minutes. Take the bag out, add milk if you like, and drink
it while it is warm. Some people add sugar or a slice of lemon instead of milk.

Counting is simple: one, two, three, four, five, six, seven, eight, nine, ten. Two plus
two is four, and three times three is nine. A week has seven days and a year has twelve
months. The quick brown fox jumps over the lazy dog.

Write a short poem about the sea. Summarize the following text in one sentence.
Translate the word into French. Give three reasons why exercise is good for you.
"""

MESSAGES = [
    {"messages": [
        {"role": "system", "content": "You are a terse assistant that answers in one sentence."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."}]},
    # No system message: the template adds the default one.
    {"messages": [
        {"role": "user", "content": "What colour is the sky on a clear day?"},
        {"role": "assistant", "content": "It is blue."}]},
    # Several turns, two assistant messages, no system message.
    {"messages": [
        {"role": "user", "content": "How do I make a cup of tea?"},
        {"role": "assistant", "content": "Boil water, pour it over a tea bag and wait three minutes."},
        {"role": "user", "content": "Can I add milk?"},
        {"role": "assistant", "content": "Yes, add milk if you like."}]},
    # Leading and trailing whitespace, which the template trims.
    {"messages": [
        {"role": "user", "content": "  Please count to three.\n"},
        {"role": "assistant", "content": "\n One, two, three.  \n\n"}]},
    # A system message, two assistant messages, a line break inside a content.
    {"messages": [
        {"role": "system", "content": "You are a helpful assistant who likes poems."},
        {"role": "user", "content": "Write a short poem about the sea."},
        {"role": "assistant", "content": "The sea is wide,\nthe sea is deep."},
        {"role": "user", "content": "Now one about snow."},
        {"role": "assistant", "content": "Snow is white\nand falls at night."}]},
]

PROMPT_COMPLETION = [
    {"prompt": [{"role": "user", "content": "What is two plus two?"}],
     "completion": [{"role": "assistant", "content": "Two plus two is four."}]},
    {"prompt": [{"role": "system", "content": "You answer with one word."},
                {"role": "user", "content": "What colour is grass?"}],
     "completion": [{"role": "assistant", "content": "Green."}]},
    {"prompt": [{"role": "user", "content": "Name a river in London."},
                {"role": "assistant", "content": "The Thames."},
                {"role": "user", "content": "And the capital of Italy?"}],
     "completion": [{"role": "assistant", "content": "The capital of Italy is Rome."}]},
]

# The prompts end without whitespace and the completions start with a space
# or a line break, so that the byte-level pre-tokenizer splits
# prompt + completion where the prompt ends and the prompt's ids are a
# prefix of the whole ids (asserted below).
PROMPT_COMPLETION_TEXT = [
    {"prompt": "The quick brown fox", "completion": " jumps over the lazy dog."},
    {"prompt": "Question: How many days does a week have?\nAnswer:",
     "completion": " A week has seven days."},
    {"prompt": "Count from one to five:", "completion": "\none, two, three, four, five"},
]

ALPACA = [
    {"instruction": "Give three reasons why exercise is good for you.", "input": "",
     "output": "It makes you stronger, it helps you sleep, and it lifts your mood."},
    {"instruction": "Summarize the following text in one sentence.",
     "input": "To make tea, boil water, put a tea bag in a cup, pour the water over it "
              "and wait for a few minutes.",
     "output": "Pour boiling water over a tea bag and wait."},
    {"instruction": "Translate the word into French.", "input": "cat", "output": "chat"},
]


def alpaca_prompt_completion(row):
    """An alpaca row as conversational prompt/completion (see the docstring)."""
    content = row["instruction"] if row["input"] == "" else row["instruction"] + "\n\n" + row["input"]
    return {"prompt": [{"role": "user", "content": content}],
            "completion": [{"role": "assistant", "content": row["output"]}]}


def train_tokenizer():
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = [line + "\n" for line in TOKENIZER_TEXT.split("\n")]
    tok.train_from_iterator(lines, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    assert tok.post_processor is None
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token=IM_END,
                                   pad_token=PAD, model_max_length=512,
                                   chat_template=CHAT_TEMPLATE)


def write_model(out, tok):
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, vocab_size=len(tok), max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=None, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, attn_implementation="eager")
    model = LlamaForCausalLM(config)
    torch.manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)

    tok.save_pretrained(out)
    # transformers writes the template to chat_template.jinja; it goes into
    # tokenizer_config.json as "chat_template" too.
    path = os.path.join(out, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")


def write_data(out):
    def jsonl(name, rows):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    jsonl("messages.jsonl", MESSAGES)
    with open(os.path.join(out, "messages.json"), "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in MESSAGES) + "\n]\n")
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(
        pyarrow.Table.from_pylist(MESSAGES),
        os.path.join(out, "messages.parquet"),
        compression="snappy",
    )
    jsonl("prompt_completion.jsonl", PROMPT_COMPLETION)
    jsonl("prompt_completion_text.jsonl", PROMPT_COMPLETION_TEXT)
    jsonl("alpaca.jsonl", ALPACA)


def read_rows(path):
    with open(path, encoding="utf-8") as f:
        if path.endswith(".json"):
            return json.load(f)
        return [json.loads(line) for line in f if line.strip()]


class Renderer:
    def __init__(self, tok):
        self.tok = tok

    def text(self, messages, gen=False):
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)

    def ids(self, text):
        return self.tok(text, add_special_tokens=False).input_ids


def prefix_len(prefix, full):
    assert full[:len(prefix)] == prefix, (prefix, full)
    return len(prefix)


def messages_example(r, messages):
    ids = r.ids(r.text(messages))
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = prefix_len(r.ids(r.text(messages[:i], gen=True)), ids)
        end = prefix_len(r.ids(r.text(messages[:i + 1])), ids)
        mask[start:end] = [1] * (end - start)
    return ids, mask


def conversational_example(r, row):
    ids = r.ids(r.text(row["prompt"] + row["completion"]))
    start = prefix_len(r.ids(r.text(row["prompt"], gen=True)), ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def text_example(r, row):
    ids = r.ids(row["prompt"] + row["completion"]) + [r.tok.eos_token_id]
    start = prefix_len(r.ids(row["prompt"]), ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def losses(model, ids, mask):
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float()
    logits, targets = logits[:-1], x[0, 1:]
    keep = torch.tensor(mask[1:], dtype=torch.bool)
    return {
        "loss_sum_completions": F.cross_entropy(logits[keep], targets[keep], reduction="sum").item(),
        "tokens_completions": int(keep.sum()),
        "loss_sum_all": F.cross_entropy(logits, targets, reduction="sum").item(),
        "tokens_all": len(ids) - 1,
    }


def write_reference(out):
    mdir = os.path.join(out, "model")
    tok = AutoTokenizer.from_pretrained(mdir)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.bos_token is None and tok.eos_token == IM_END and tok.pad_token == PAD
    assert model.config.vocab_size == len(tok) == VOCAB
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    for s in ("hello", "The sky is blue."):
        assert tok(s).input_ids == tok(s, add_special_tokens=False).input_ids
    r = Renderer(tok)

    files = {
        "messages.jsonl": lambda row: messages_example(r, row["messages"]),
        "messages.json": lambda row: messages_example(r, row["messages"]),
        "prompt_completion.jsonl": lambda row: conversational_example(r, row),
        "prompt_completion_text.jsonl": lambda row: text_example(r, row),
        "alpaca.jsonl": lambda row: conversational_example(r, alpaca_prompt_completion(row)),
    }
    per_file, loss_completions, loss_all = {}, {}, {}
    for name, example in files.items():
        rows = read_rows(os.path.join(out, name))
        examples = []
        for row in rows:
            ids, mask = example(row)
            assert len(ids) <= model.config.max_position_embeddings
            assert len(ids) == len(mask) and sum(mask) > 0
            examples.append({"input_ids": ids, "completion_mask": mask, **losses(model, ids, mask)})
        per_file[name] = examples
        loss_completions[name] = (sum(e["loss_sum_completions"] for e in examples)
                                  / sum(e["tokens_completions"] for e in examples))
        loss_all[name] = (sum(e["loss_sum_all"] for e in examples)
                          / sum(e["tokens_all"] for e in examples))
        print(f"{name}: {len(examples)} examples, {sum(len(e['input_ids']) for e in examples)} "
              f"tokens, loss_completions {loss_completions[name]:.6f}, "
              f"loss_all {loss_all[name]:.6f}")

    first = read_rows(os.path.join(out, "messages.jsonl"))
    rendered = [r.text(row["messages"]) for row in first]
    assert rendered == [r.text(row["messages"]) for row in read_rows(os.path.join(out, "messages.json"))]
    top = {
        "vocab_size": len(tok),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "loss_completions": loss_completions,
        "loss_all": loss_all,
        "rendered": rendered,
        "generation_prompt_rendered": r.text(first[0]["messages"][:1], gen=True),
    }
    with open(os.path.join(out, "reference.json"), "w", encoding="utf-8") as f:
        # One key a line; each file's examples one a line.
        lines = [f"  {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}" for k, v in top.items()]
        for name, examples in per_file.items():
            body = ",\n".join("    " + json.dumps(e) for e in examples)
            lines.append(f"  {json.dumps(name)}: [\n{body}\n  ]")
        f.write("{\n" + ",\n".join(lines) + "\n}\n")


def main(out):
    print("transformers", transformers.__version__, "torch", torch.__version__,
          "tokenizers", tokenizers.__version__)
    torch.set_default_dtype(torch.float32)
    os.makedirs(out, exist_ok=True)
    mdir = os.path.join(out, "model")
    shutil.rmtree(mdir, ignore_errors=True)
    write_model(mdir, train_tokenizer())
    write_data(out)
    write_reference(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "chat"))
