"""Parse the text printed by ``gcomp.ir.printer`` back into a ``Graph``.

``parse_graph(print_graph(g))`` prints identically to ``g``; types written in
the text are checked against the inferred ones, so a fixture with a wrong type
is reported rather than silently corrected.  ``#`` starts a comment; ``#:`` starts
the annotations ``print_graph(g, show_meta=True)`` writes (JSON), read back into
``node.meta`` (``#: graph`` on a line of its own: ``graph.meta``).
"""

from __future__ import annotations

import json
import re

from gcomp.errors import IRError
from gcomp.ir.graph import Graph
from gcomp.ir.ops import OPS, Op, op_from_name
from gcomp.ir.types import parse_type

_HEADER = re.compile(r"^graph\s+([A-Za-z_][A-Za-z0-9_.]*)\s*\((.*)\)\s*\{$")
_NODE = re.compile(r"^%([A-Za-z_][A-Za-z0-9_.]*)\s*=\s*([a-z_]+)(.*)$")
_RETURN = re.compile(r"^return\b(.*)$")
_decoder = json.JSONDecoder()


def _split_comment(line: str) -> tuple[str, str]:
    """(the code, the comment after its ``#``)."""
    # '#' never occurs inside our JSON attribute strings except in quotes
    quoted = False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        if ch == "#" and not quoted:
            return line[:i].strip(), line[i + 1:]
    return line.strip(), ""


def _annotation(comment: str, lineno: int) -> dict | None:
    """The JSON object of a ``#:`` annotation, or None for a plain comment."""
    if not comment.startswith(":"):
        return None
    try:
        meta = json.loads(comment[1:])
    except json.JSONDecodeError as e:
        raise IRError(f"line {lineno}: bad annotation (#: takes a JSON object): {e}") from None
    if not isinstance(meta, dict):
        raise IRError(f"line {lineno}: bad annotation (#: takes a JSON object)")
    return meta


def _parse_attrs(text: str, lineno: int) -> tuple[dict, str]:
    """Parse a leading ``[k=json, ...]``; return the attrs and the rest of the text."""
    attrs: dict = {}
    if not text.startswith("["):
        return attrs, text
    i = 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i < len(text) and text[i] == "]":
            return attrs, text[i + 1:].strip()
        m = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=").match(text, i)
        if not m:
            raise IRError(f"line {lineno}: cannot parse attributes in {text!r}")
        try:
            value, end = _decoder.raw_decode(text, m.end())
        except json.JSONDecodeError as e:
            raise IRError(f"line {lineno}: bad value for attribute {m.group(1)}: {e}") from None
        attrs[m.group(1)] = value
        i = end


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "[(<":
            depth += 1
        elif ch in "])>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return [p.strip() for p in parts]


def _ref(g: Graph, token: str, lineno: int):
    if not token.startswith("%"):
        raise IRError(f"line {lineno}: expected a %value, got {token!r}")
    name = token[1:]
    if not g.has(name):
        raise IRError(f"line {lineno}: %{name} is used before it is defined")
    return g.node(name)


def parse_graph(text: str) -> Graph:
    header_meta: dict = {}  # "graph" or an input's name -> its annotations
    lines = []
    for i, raw in enumerate(text.splitlines()):
        code, comment = _split_comment(raw)
        if code:
            lines.append((i + 1, code, comment))
            continue
        m = re.match(r"^:\s*(graph|%[A-Za-z_][A-Za-z0-9_.]*)\s", comment)
        if m:
            header_meta[m.group(1)] = _annotation(":" + comment[m.end():], i + 1)
    if not lines:
        raise IRError("empty IR text")
    lineno, head, _ = lines[0]
    m = _HEADER.match(head)
    if not m:
        raise IRError(f"line {lineno}: expected 'graph NAME(...) {{', got {head!r}")
    g = Graph(m.group(1))
    for part in _split_top(m.group(2)):
        name, _, ty = part.partition(":")
        name = name.strip()
        if not name.startswith("%") or not ty:
            raise IRError(f"line {lineno}: bad input declaration {part!r}")
        g.create_node(Op.INPUT, ty=parse_type(ty), name=name[1:])
    for key, meta in header_meta.items():
        if key == "graph":
            g.meta.update(meta)
        elif g.has(key[1:]) and g.node(key[1:]).op == Op.INPUT:
            g.node(key[1:]).meta.update(meta)
        else:
            raise IRError(f"an annotation names %{key[1:]}, which is not an input of the graph")
    done = False
    for lineno, line, comment in lines[1:]:
        if done:
            raise IRError(f"line {lineno}: text after the closing brace")
        if line == "}":
            done = True
            continue
        r = _RETURN.match(line)
        if r:
            g.set_outputs(_ref(g, t, lineno) for t in _split_top(r.group(1)))
            continue
        m = _NODE.match(line)
        if not m:
            raise IRError(f"line {lineno}: cannot parse {line!r}")
        name, op = m.group(1), op_from_name(m.group(2))
        attrs, rest = _parse_attrs(m.group(3).strip(), lineno)
        args = []
        if rest.startswith("("):
            close = rest.find(")")
            args = [_ref(g, t, lineno) for t in _split_top(rest[1:close])]
            rest = rest[close + 1:].strip()
        if not rest.startswith(":"):
            raise IRError(f"line {lineno}: missing ': type' in {line!r}")
        ty = parse_type(rest[1:])
        try:
            node = g.create_node(op, args, attrs, ty=ty, name=name)
        except IRError as e:
            raise IRError(f"line {lineno}: {e}") from None
        if OPS[op].infer is not None and node.ty != ty:
            raise IRError(f"line {lineno}: %{name} is written as {ty} but its type is {node.ty}")
        meta = _annotation(comment, lineno)
        if meta:
            node.meta.update(meta)
    if not done:
        raise IRError("missing closing brace")
    return g
