"""``--chat-template-content-format auto``: whether a chat template reads a message's
content as a string or as OpenAI's list of parts, decided as vLLM does from the
template's syntax tree (parsed, never rendered)."""

from __future__ import annotations

import functools
from collections import deque
from typing import Any

import jinja2.ext
import jinja2.nodes as jn
import jinja2.sandbox


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` block, parsed (its body
    kept) so that templates using it can be read."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jn.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jn.Scope(body, lineno=lineno)


# parses templates (never renders): the options and extensions transformers renders with
_TEMPLATE_PARSER = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True,
    extensions=[_GenerationBlock, jinja2.ext.loopcontrols])


def _reads(node: jn.Node | None, names: set[str], key: str | None = None) -> bool:
    """Whether ``node`` is one of the variables ``names`` (with ``key``: its item ``key``,
    ``x['key']`` or ``x.key``), through filters, tests and slices on the outside."""
    while isinstance(node, jn.Filter | jn.Test) or (
            isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, jn.Getitem):
            named = isinstance(node.arg, jn.Const) and node.arg.value == key
        else:
            named = isinstance(node, jn.Getattr) and node.attr == key
        return named and _reads(node.node, names)  # type: ignore[union-attr]
    return isinstance(node, jn.Name) and node.ctx == "load" and node.name in names


@functools.lru_cache(maxsize=32)
def detected_content_format(template: str) -> str:
    """``--chat-template-content-format auto``, as vLLM decides it from the template's
    syntax tree: ``openai`` (content as a list of parts) when it loops over a message's
    content (``{% for part in message['content'] %}``, a message being a loop variable
    over ``messages`` or over a variable set from it), else ``string`` (also for a
    template that does not parse)."""
    try:
        root = _TEMPLATE_PARSER.parse(template)
    except Exception:  # rendering reports it
        return "string"
    loops = list(root.find_all(jn.For))
    assigns = [a for a in root.find_all(jn.Assign) if isinstance(a.target, jn.Name)]
    conversations, todo = {"messages"}, deque(["messages"])
    while todo:  # variables set from messages (a slice, a filter of it, ...), and theirs
        name = todo.popleft()
        for a in assigns:
            if a.target.name not in conversations and _reads(a.node, {name}):
                conversations.add(a.target.name)
                todo.append(a.target.name)
    messages = {loop.target.name for loop in loops
                if isinstance(loop.target, jn.Name) and _reads(loop.iter, conversations)}
    if any(_reads(loop.iter, messages, "content") for loop in loops):
        return "openai"
    return "string"
