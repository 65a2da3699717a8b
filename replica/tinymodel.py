"""``python -m replica.tinymodel DIR``: build a tiny random Llama that real vLLM (CPU) can serve.

Sizes follow docs/design.md#environment-facts (hidden 256, 4 heads of 64, 2 KV heads, 2 layers,
vocab 2048), with a
byte-level BPE tokenizer trained locally with ``tokenizers`` on generated text. Nothing is
downloaded; the weights are random (seeded), so the output is gibberish, but prefix caching,
scheduling and metrics behave as with a real model. Needs ``transformers`` and ``torch`` (the
``replica`` extra).
"""

from __future__ import annotations

import argparse
import pathlib
import random

VOCAB = 2048


def _corpus(n: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [
        "the",
        "cache",
        "prefix",
        "token",
        "router",
        "replica",
        "model",
        "request",
        "system",
        "prompt",
        "user",
        "assistant",
        "answer",
        "question",
        "document",
        "kv",
        "block",
        "hash",
        "queue",
        "load",
    ]
    return [
        " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(rng.randrange(5, 40)))
        for _ in range(n)
    ]


def build(out: pathlib.Path, seed: int = 0) -> pathlib.Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    fast.save_pretrained(out)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replica.tinymodel", description=__doc__)
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"tiny model written to {build(pathlib.Path(a.dir), a.seed)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
