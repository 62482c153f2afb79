"""`ringtrain VERB --help` for every verb: exit 0 with the verb's usage, no traceback.

argparse %-formats each help text when it prints it, so a help string holding a literal ``%``
(a Jinja tag, a percentage) fails only when someone asks for help; this runs them all.
"""

from __future__ import annotations

import argparse

import pytest

from ringtrain import cli


def _verbs() -> list[str]:
    """Every verb the parser knows: cli.VERBS' and the job verbs (submit, status, logs, stop)."""
    sub = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_every_verb_of_the_table_is_asked_for_help() -> None:
    assert set(cli.VERBS) <= set(_verbs())


@pytest.mark.parametrize("verb", _verbs())
def test_help_exits_0_with_the_verbs_usage(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([verb, "--help"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    assert out.startswith(f"usage: ringtrain {verb}") and err == ""
