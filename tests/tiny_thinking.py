"""A tiny random Qwen3 with a thinking chat template, built offline in tests/tiny_models.py's style.

`<think>`, `</think>`, `<tool_call>`, `</tool_call>` are added (non-special, as in Qwen3's tokenizer) after the
byte-level vocabulary, and the model's vocab_size counts them. The template writes Qwen3's tool block, and with
`enable_thinking: false` the closed empty think block Qwen3 puts in the prompt; otherwise the model opens
`<think>` itself. DEEPSEEK_TEMPLATE is an R1-style template that opens `<think>` in the prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
QWEN3_THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}<｜User｜>{{ message['content'] }}"
    "{% else %}<｜Assistant｜>{{ message['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def make_thinking_tokenizer() -> Any:
    from tokenizers import AddedToken

    from tiny_models import make_tiny_tokenizer

    tok = make_tiny_tokenizer(add_bos=False)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = QWEN3_THINKING_TEMPLATE
    return tok


def make_thinking_model(tmp_path: str | Path) -> Path:
    """The model folder (random qwen3 weights, the thinking tokenizer)."""
    from tiny_models import make_tiny_model

    tok = make_thinking_tokenizer()
    path = make_tiny_model(tmp_path, arch="qwen3", vocab_size=len(tok), name="tiny-qwen3-thinking",
                           hidden_size=128, head_dim=64, num_hidden_layers=1)
    tok.save_pretrained(str(path))
    return path
