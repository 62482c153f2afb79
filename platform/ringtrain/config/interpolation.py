"""Which OmegaConf interpolations a job may use: references to other keys, never resolver calls.

A resolver runs code while the config resolves: ``${oc.env:NAME}`` reads the submitting
machine's environment (``checkpoint.uri=s3://elsewhere/${oc.env:AWS_SECRET_ACCESS_KEY}`` sends
a secret to someone else's bucket and writes it into the run directory), ``oc.decode`` parses a
string as a new interpolation, ``oc.select`` takes another interpolation as its default, and a
resolver registered elsewhere may read anything. A job file is data, so every resolver call is
refused; ``${train.lr}`` style references to keys of the same config stay allowed.

The check runs on what a user wrote (before OmegaConf resolves anything) and again on the
resolved values, where an escaped ``\\${oc.env:X}`` has become live interpolation text that a
later merge of the config would resolve.
"""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
from omegaconf.grammar_parser import parse

from ringtrain.config.tree import leaves
from ringtrain.errors import ConfigError

# Seen in a value, the start of an interpolation; cheaper to test than parsing every string.
_OPEN = "${"


def resolver_calls(text: str) -> list[str]:
    """The resolvers ``text`` calls (``oc.env``, ...), nested ones included, in order."""
    if _OPEN not in text:
        return []
    try:
        tree = parse(text)
    except GrammarParseError:
        return []  # not an interpolation OmegaConf could run: it stays a plain string
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            found.append(node.resolverName().getText())
        for child in getattr(node, "children", None) or ():
            if hasattr(child, "children"):
                walk(child)

    walk(tree)
    return found


def refuse_resolvers(tree: Any, where: str = "") -> None:
    """ConfigError naming the first key whose value calls a resolver; ``tree`` is plain data or
    an OmegaConf container (read without resolving), ``where`` names its file for the message."""
    if OmegaConf.is_config(tree):
        tree = OmegaConf.to_container(tree, resolve=False)
    for key, text in leaves(tree):
        calls = resolver_calls(text) if isinstance(text, str) else []
        if calls:
            raise ConfigError(key or "config", _reason(text, calls, where))


def _reason(text: str, calls: list[str], where: Optional[str]) -> str:
    reads_env = " reads the environment and" if "oc.env" in calls else ""
    source = f" in {where}" if where else ""
    return (
        f"{text!r}{source} calls the resolver {calls[0]!r}, which{reads_env} is refused: a job may refer "
        "to other keys (${section.key}) but not call resolvers; write the value itself"
    )
