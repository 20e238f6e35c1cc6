"""Lark-syntax grammars as xgrammar's EBNF, as vLLM's xgrammar backend takes them.

vLLM reads a ``grammar`` without ``::=`` as Lark (``looks_like_lark``). Its current
xgrammar backend compiles such a grammar with xgrammar's own Lark reader (regular
expressions, ``%import common``, ``%ignore``, ``"..."i``; ``start`` required); earlier
releases converted it to EBNF themselves (single-quoted literals, no ``start`` needed).
``lark_to_ebnf`` takes both: xgrammar's reader first, its grammar printed as EBNF; where
that reader refuses the text, this module's own conversion:

- ``name: alt | alt`` becomes ``name ::= alt | alt``; a line starting with ``|`` (or
  after a line ending in ``\\``) continues the rule above; ``//`` and ``#`` comments and
  blank lines go; a rule's ``?`` / ``!`` modifiers, its priority (``name.2:``) and an
  alternative's alias (``-> name``) shape Lark's parse tree only and are dropped;
- the entry rule is ``start`` (Lark's) or else the first rule (vLLM's), renamed ``root``
  (a rule of the grammar named ``root`` gets a free name);
- ``"..."`` and ``'...'`` literals (Lark's escapes: ``\\n``, ``\\t``, ``\\r``,
  ``\\f``, ``\\xhh``, ``\\uhhhh``, ``\\Uhhhhhhhh``, ``\\\\`` and the quote; any other
  backslash stays one) become JSON-style double-quoted strings (xgrammar's escapes; the
  characters themselves in UTF-8), ``"a".."z"`` a character class;
- ``[x]`` (Lark: optional; EBNF: a character class) becomes ``(x)?``, ``x ~ n`` and
  ``x ~ n..m`` become ``x{n}`` and ``x{n,m}``; ``( )``, ``*``, ``+``, ``?`` stay.

What neither takes raises ``GrammarError`` naming the line (the conversion's reason, then
the reader's): for the conversion, regular expressions ``/.../``, ``%`` directives,
string flags, templates, a reference to an undefined rule, or text that is no Lark.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import xgrammar as xgr

from tpserve.server.engine.structured.spec import GrammarError, clean_message

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r\f]+) | (?P<comment>(?://|\#)[^\n]*) | (?P<newline>\n)
  | (?P<joined>\\[ ]*\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')(?P<flags>[A-Za-z]*)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[a-z]*)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<rule>(?:!\??|\?!?)?[_A-Za-z][_A-Za-z0-9]*)
  | (?P<number>[0-9]+)
  | (?P<op>->|\.\.|[:|*+?()\[\]~.])
""", re.VERBOSE)
_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8}|.)")
_SIMPLE = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "\\": "\\"}
_IN_CLASS = frozenset("\\]-^[")  # escaped inside an EBNF character class


def looks_like_lark(grammar: str) -> bool:
    """Whether vLLM would read ``grammar`` as Lark: it has no EBNF ``::=``."""
    return "::=" not in grammar


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    line: int


def lark_to_ebnf(grammar: str) -> str:
    """``grammar`` (Lark) as xgrammar EBNF whose ``root`` is its entry rule: xgrammar's
    Lark reader's, else this module's conversion; ``GrammarError`` if neither takes it."""
    try:
        return str(xgr.Grammar.from_lark(grammar))
    except (RuntimeError, ValueError, TypeError) as exc:
        # its first line; the next ones repeat the grammar's line with a caret
        refused = clean_message(RuntimeError((str(exc).strip() or "refused").splitlines()[0]))
    try:
        return converted(grammar)
    except GrammarError as exc:
        raise GrammarError(f"{exc} (xgrammar's Lark reader: {refused})") from None


def converted(grammar: str) -> str:
    """This module's own conversion of ``grammar`` (Lark; the module docstring lists
    what it converts); ``GrammarError`` naming the line for what it cannot."""
    rules = _rules(_tokens(grammar))
    if not rules:
        raise GrammarError("a Lark grammar needs at least one rule (name: ...)")
    names = [name for name, _, _ in rules]
    entry = "start" if "start" in names else names[0]
    renamed = {name: name for name in names}
    if entry != "root" and "root" in names:  # a rule of its own: give it a free name
        renamed["root"] = next(f"root{'_' * n}" for n in range(1, len(names) + 1)
                               if f"root{'_' * n}" not in names)
    renamed[entry] = "root"
    return "\n".join(f"{renamed[name]} ::= {_Body(body, renamed, line).expansions()}"
                     for name, body, line in rules) + "\n"


def _tokens(grammar: str) -> list[_Token]:
    tokens, line, pos = [], 1, 0
    while pos < len(grammar):
        match = _TOKEN.match(grammar, pos)
        if match is None:
            what = ("templates (name{...})" if grammar[pos] == "{" else
                    f"{grammar[pos]!r}, which is no Lark syntax,")
            raise GrammarError(f"line {line}: {what} cannot be converted to EBNF")
        kind = "string" if match.lastgroup == "flags" else str(match.lastgroup)
        if kind == "string" and match.group("flags"):
            raise GrammarError(f"line {line}: string flags ({match.group('flags')}) cannot "
                               "be converted to EBNF")
        if kind == "regex":
            raise GrammarError(f"line {line}: regular expressions ({match.group()}) cannot "
                               "be converted to EBNF")
        if kind == "directive":
            raise GrammarError(f"line {line}: {match.group()} cannot be converted to EBNF "
                               "(define every rule in the grammar)")
        if kind not in ("space", "comment", "joined"):
            tokens.append(_Token(kind, match.group(kind), line))
        line += kind in ("newline", "joined")
        pos = match.end()
    return tokens


def _rules(tokens: list[_Token]) -> list[tuple[str, list[_Token], int]]:
    """The definitions in order, each its name, body tokens (continuation lines joined,
    newlines gone) and line."""
    rules: list[tuple[str, list[_Token], int]] = []
    lines: list[list[_Token]] = [[]]
    for token in tokens:
        if token.kind == "newline":
            lines.append([])
        else:
            lines[-1].append(token)
    for line in filter(None, lines):
        first = line[0]
        if first.text == "|":
            if not rules:
                raise GrammarError(f"line {first.line}: '|' continues no rule")
            rules[-1][1].extend(line)
            continue
        head = 1
        if len(line) > 2 and line[1].text == "." and line[2].kind == "number":
            head = 3  # a priority: name.2
        if first.kind != "rule" or len(line) <= head or line[head].text != ":":
            raise GrammarError(f"line {first.line}: expected a rule (name: ...)")
        name = first.text.lstrip("?!")
        if any(name == known for known, _, _ in rules):
            raise GrammarError(f"line {first.line}: the rule {name} is defined twice")
        rules.append((name, line[head + 1:], first.line))
    return rules


class _Body:
    """One rule's body parsed (recursive descent over Lark's expression syntax) and
    written as EBNF."""

    def __init__(self, tokens: list[_Token], renamed: dict[str, str], line: int):
        self.tokens = tokens
        self.renamed = renamed
        self.line = line  # the definition's, for an error at the end of the rule
        self.pos = 0

    def _peek(self) -> _Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self, text: str | None = None) -> _Token:
        token = self._peek()
        if token is None or (text is not None and token.text != text):
            found = repr(token.text) if token else "the end of the rule"
            raise GrammarError(f"line {token.line if token else self.line}: expected "
                               f"{text or 'more'}, found {found}")
        self.pos += 1
        return token

    def expansions(self, closing: str | None = None) -> str:
        alternatives = [self._alternative()]
        while (token := self._peek()) is not None and token.text == "|":
            self._take()
            alternatives.append(self._alternative())
        token = self._peek()
        if closing is None and token is not None:
            raise GrammarError(f"line {token.line}: unexpected {token.text!r}")
        return " | ".join(alternatives)

    def _alternative(self) -> str:
        items = []
        while (token := self._peek()) is not None and token.text not in ("|", ")", "]"):
            if token.text == "->":  # an alias names the tree node only
                self._take()
                self._take_kind("rule")
                continue
            items.append(self._item())
        return " ".join(items) or '""'

    def _take_kind(self, kind: str) -> _Token:
        token = self._take()
        if token.kind != kind:
            raise GrammarError(f"line {token.line}: expected a {kind}, found {token.text!r}")
        return token

    def _item(self) -> str:
        atom = self._atom()
        token = self._peek()
        if token is not None and token.text in ("*", "+", "?"):
            self._take()
            return atom + token.text
        if token is not None and token.text == "~":
            self._take()
            low = self._take_kind("number").text
            if (after := self._peek()) is not None and after.text == "..":
                self._take()
                return f"{atom}{{{low},{self._take_kind('number').text}}}"
            return f"{atom}{{{low}}}"
        return atom

    def _atom(self) -> str:
        token = self._take()
        if token.text in ("(", "["):
            closing = ")" if token.text == "(" else "]"
            inner = self.expansions(closing)
            self._take(closing)
            return f"({inner})" if closing == ")" else f"({inner})?"
        if token.kind == "string":
            value = _string_value(token)
            if (after := self._peek()) is not None and after.text == "..":
                self._take()
                return _char_range(value, _string_value(self._take_kind("string")), token)
            return json.dumps(value, ensure_ascii=False)
        if token.kind == "rule":
            if token.text not in self.renamed:
                raise GrammarError(f"line {token.line}: the rule {token.text} is not "
                                   "defined")
            return self.renamed[token.text]
        raise GrammarError(f"line {token.line}: unexpected {token.text!r}")


def _string_value(token: _Token) -> str:
    """A literal's text with Lark's escapes read (the module docstring lists them)."""
    quote = token.text[0]

    def unescape(match: re.Match[str]) -> str:
        code = match.group()[1:]
        if code[0] in "xuU" and len(code) > 1:
            if int(code[1:], 16) > 0x10FFFF:
                raise GrammarError(f"line {token.line}: \\{code} is no character")
            return chr(int(code[1:], 16))
        return _SIMPLE.get(code, quote if code == quote else match.group())

    value = _ESCAPE.sub(unescape, token.text[1:-1])
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise GrammarError(f"line {token.line}: {token.text} holds a lone surrogate") from None
    return value


def _char_range(low: str, high: str, token: _Token) -> str:
    if len(low) != 1 or len(high) != 1 or low > high:
        raise GrammarError(f"line {token.line}: a range needs two single characters, the "
                           "first not above the second")

    def one(c: str) -> str:
        if c in _IN_CLASS:
            return "\\" + c
        return f"\\u{ord(c):04x}" if ord(c) < 0x20 or c == "\x7f" else c

    return f"[{one(low)}-{one(high)}]"
