"""``python -m replica.sim --help`` explains every flag and shows its default."""

from __future__ import annotations

import subprocess
import sys

from replica.sim.__main__ import parser


def test_every_flag_has_a_help_text_and_shows_its_default() -> None:
    p = parser()
    flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert len(flags) > 15
    assert not [a.dest for a in flags if not a.help], "flags without a help text"
    text = " ".join(p.format_help().split())
    for a in flags:
        assert a.help is not None and " ".join(a.help.split()) in text
    assert "(default: 8000)" in text and "(default: h100-llama-3.1-8b)" in text
    assert "(default: True)" in text, "BooleanOptionalAction flags show theirs too"


def test_help_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "replica.sim", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "--time-scale" in done.stdout and "(default: 1.0)" in done.stdout
