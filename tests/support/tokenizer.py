"""A small byte-level BPE tokenizer trained locally on :func:`replica.tinymodel._corpus` word
salad, written as the files :func:`picker.core.tokenize.load` reads."""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from replica.tinymodel import _corpus

STRING_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
"""A chat template for string contents only: ``<s>role: content`` lines."""


def tokenizer_dir(
    out: pathlib.Path,
    chat_template: str,
    *,
    vocab_size: int = 2048,
    lines: int = 1000,
    add_bos: bool = False,
    add_eos: bool = False,
) -> pathlib.Path:
    """Train a BPE tokenizer of ``vocab_size`` on ``lines`` corpus lines (seed 0; special tokens
    ``<s>`` = 0 and ``</s>`` = 1, which the config names BOS and EOS) and write
    ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``out``.
    ``add_bos``: encoding prepends ``<s>``, ``add_eos``: appends ``</s>`` (a post-processor, with
    the special tokens; a plain encode is unchanged). Returns ``out``."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(lines), trainer)
    if add_bos or add_eos:
        single = " ".join([*(["<s>"] if add_bos else []), "$A", *(["</s>"] if add_eos else [])])
        special = [(t, i) for t, i in (("<s>", 0), ("</s>", 1)) if t in single]
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (out / "chat_template.jinja").write_text(chat_template)
    return out
