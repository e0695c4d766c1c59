"""What every refusal of the command line looks like to a user, checked in one place: exit code
2, no traceback, one line on the output that starts ``error:`` and names what was wrong."""

from __future__ import annotations

from dmbench.errors import ExitCode


def assert_refused_in_one_line(result, *named: str) -> str:
    """``result`` (a ``CliRunner`` invocation) refused its input as the harness promises; each
    of ``named`` is in the one line. Returns that line."""
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: "), lines[0]
    for text in named:
        assert text in lines[0], lines[0]
    return lines[0]
