"""Token-exact request hashing: OpenAI bodies → the token ids the replica will see.

- :mod:`picker.core.tokenize.chat`: the chat template rendered as vLLM renders it (jinja2, as HF
  ``apply_chat_template``), messages normalised as vLLM normalises them.
- :mod:`picker.core.tokenize.cache`: tokenizations of repeated prefixes reused.
- :mod:`picker.core.tokenize.hf`: the model's ``tokenizer.json`` (HF ``tokenizers``) and the
  :class:`PromptTokenizer` the router calls.

No torch, vllm or transformers here: ``tokenizers`` and ``jinja2`` only.
"""

from picker.core.tokenize.hf import HFPromptTokenizer, PromptTokenizer, load

__all__ = ["HFPromptTokenizer", "PromptTokenizer", "load"]
