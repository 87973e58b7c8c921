"""A tiny local model and data set for DeepSpeed-Chat's training scripts (deepspeed_chat/, copies), so they
run without the hub: the scripts take `--model_name_or_path DIR` (an argument, not a text change) and read
`--data_path local/jsonfile` from `deepspeed_chat/data/{train,eval}.json` (their own local-data path).

    python tiny_chat.py model DIR     writes a 2-layer OPT (hidden 16, seeded) and its word-level tokenizer
    python tiny_chat.py data          rewrites deepspeed_chat/data/*.json (committed; this is how they were made)

The tokenizer mirrors what the scripts assume of OPT's: `</s>` is bos, eos and (the scripts set it) the pad
token, and it is put before every text, so the reward model's `num_padding_at_beginning=1` holds. The
model has no biases and no dropout: a bias that gets no gradient (attention keys) would make Adam's
updates depend on float noise, and dropout masks on the order of random draws; neither is under test.
Written for these tests (not a copy).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHAT = HERE / "deepspeed_chat"
SPECIALS = ["<pad>", "</s>", "<unk>", "<|endoftext|>"]
NUMBERS = [str(n) for n in range(19)]
WORDS = ["Human:", "Assistant:", "what", "is", "plus", "minus", "?", "the", "answer", "it", "maybe", "sure",
         "no", "idea", "."]
VOCAB = SPECIALS + WORDS + NUMBERS  # 38 tokens; the embedding is 40 rows (the scripts round up to 8)
EMBED_ROWS = 40


def rows(count: int, seed: int) -> list[dict]:
    """Arithmetic questions with a right (chosen) and a wrong (rejected) answer of different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randrange(10), rng.randrange(9)
        op, value = ("plus", a + b) if rng.random() < 0.5 else ("minus", abs(a - b))
        wrong = (value + rng.randrange(1, 5)) % 19
        out.append({"prompt": f"Human: what is {a} {op} {b} ? Assistant:",
                    "chosen": f"the answer is {value} .", "rejected": f"maybe {wrong}"})
    return out


def write_data() -> None:
    (CHAT / "data").mkdir(exist_ok=True)
    for name, count, seed in (("train", 16, 1), ("eval", 8, 2)):
        with open(CHAT / "data" / f"{name}.json", "w") as f:
            json.dump(rows(count, seed), f, indent=0)
            f.write("\n")


def write_model(out: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A $B",
                                                        special_tokens=[("</s>", vocab["</s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="</s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>",
                                        additional_special_tokens=["<|endoftext|>"])
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=EMBED_ROWS, hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                       enable_bias=False, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       layerdrop=0.0, pad_token_id=vocab["<pad>"], bos_token_id=vocab["</s>"],
                       eos_token_id=vocab["</s>"])
    model = OPTForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def weights_sha256(out: str) -> str:
    """A digest of the written model's tensors (names, dtypes, shapes, bytes): the recorded DeepSpeed losses
    hold for these weights only, so a transformers whose initialization draws differently must re-record."""
    import hashlib

    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(str(Path(out) / "model.safetensors")).items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    if sys.argv[1:2] == ["data"]:
        write_data()
    elif sys.argv[1:2] == ["model"] and len(sys.argv) == 3:
        write_model(sys.argv[2])
    else:
        raise SystemExit(__doc__)
