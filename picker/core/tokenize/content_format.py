"""Which message-content format a chat template expects, detected as vLLM 0.32 detects it
(``vllm/entrypoints/chat_utils.py``, ``_detect_content_format``): on the template's jinja2 AST,
not its text.

"openai" when the template loops over a message's content (``{% for part in message['content'] %}``
or ``message.content``), where a message is the loop variable of a loop over ``messages`` or over a
name assigned from it (``{% set msgs = messages[1:] %}``, through filters, tests and slices);
"string" otherwise. vLLM then passes "string" content as text parts joined with newlines, and
"openai" content as the list of ``{"type": "text", ...}`` parts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import jinja2
import jinja2.nodes as n

ContentFormat = Literal["string", "openai"]


def detect(env: jinja2.Environment, source: str) -> ContentFormat:
    """The content format ``source`` expects (``"string"`` if it does not parse, as vLLM)."""
    try:
        root = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = set(_aliases(root, "messages"))
    items = {name for name, loop in _loops(root) if _reads(loop.iter, messages)}
    return "openai" if any(_reads(loop.iter, items, "content") for _, loop in _loops(root)) else "string"


def _loops(root: n.Node) -> Iterator[tuple[str, n.For]]:
    """``for`` loops with a single loop variable, and its name (``for a, b in …`` unpacks no
    message)."""
    for f in root.find_all(n.For):
        if isinstance(f.target, n.Name):
            yield f.target.name, f


def _aliases(root: n.Node, name: str) -> list[str]:
    """``name`` and every name assigned, directly or through another alias, from a read of it."""
    found = [name]
    todo = [name]
    while todo:
        current = {todo.pop()}
        for a in root.find_all(n.Assign):
            if isinstance(a.target, n.Name) and a.target.name not in found and _reads(a.node, current):
                found.append(a.target.name)
                todo.append(a.target.name)
    return found


def _reads(node: n.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` reads one of ``names`` (with ``key``: its item or attribute ``key``), possibly
    through filters (``|selectattr…``), tests and slices (``[1:]``)."""
    if isinstance(node, n.Filter | n.Test):
        return node.node is not None and _reads(node.node, names, key)
    if isinstance(node, n.Getitem) and isinstance(node.arg, n.Slice):
        return _reads(node.node, names, key)
    if key is None:
        return isinstance(node, n.Name) and node.ctx == "load" and node.name in names
    if isinstance(node, n.Getitem):
        return isinstance(node.arg, n.Const) and node.arg.value == key and _reads(node.node, names)
    if isinstance(node, n.Getattr):
        return node.attr == key and _reads(node.node, names)
    return False
