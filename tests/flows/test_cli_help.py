"""Help texts are plain text: no rich markup or emoji codes read into them (before: ``rescore --help``
showed the ``--iterations`` help "A:B: only ..." as "A🅱 only ...", rich reading ":B:" as an emoji)."""

from __future__ import annotations

from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


def test_help_shows_the_text_as_written() -> None:
    result = runner.invoke(app, ["rescore", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "A:B: only training/validation iterations A <= i < B" in " ".join(result.stdout.split())
    assert "\N{NEGATIVE SQUARED LATIN CAPITAL LETTER B}" not in result.stdout
    for args in (["--help"], ["config", "show", "--help"], ["runs", "list", "--help"], ["doctor", "--help"]):
        text = runner.invoke(app, args).stdout
        assert "Usage" in text and not any(ord(ch) > 0x2FFF for ch in text), args  # no emoji
