"""The chat template's content format, detected on its jinja2 AST as vLLM detects it
(``picker.core.tokenize.content_format``): the cases a text match got wrong included."""

from __future__ import annotations

import jinja2
import pytest

from picker.core.tokenize.content_format import detect

ENV = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
        # through an alias of messages, a slice and a filter (Llama 3.x / Qwen-VL style)
        (
            "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
            "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}"
            "{% endfor %}",
            "openai",
        ),
        (
            "{% set a = messages %}{% set b = a %}{% for m in b %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "openai",
        ),
        # a loop over something else's content is not a message's content
        ("{% for d in documents %}{% for p in d.content %}{{ p }}{% endfor %}{% endfor %}", "string"),
        # the text mentions a content loop only in a string or a comment
        ("{# for x in m.content #}{% for m in messages %}{{ 'for p in m.content' }}{% endfor %}", "string"),
        # the text has no loop over a content, but the AST does (spaces and a pipe the regex missed)
        (
            "{%- for message in messages -%}{%- for c in (message['content'] | list) -%}{%- endfor -%}{%- endfor -%}",
            "openai",
        ),
        (
            "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% endif %}{% endfor %}",
            "string",
        ),
        ("{% for m in messages %", "string"),  # does not parse: vLLM's default
    ],
)
def test_content_format(template: str, expected: str) -> None:
    assert detect(ENV, template) == expected
