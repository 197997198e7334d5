"""Shared assertion for CLI error tests: a user error is exactly one stderr line, never a traceback."""


def one_error_line(capsys) -> str:
    """The single stderr line of the last CLI call (asserts no traceback and exactly one line)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
