"""A command's start-up lines (kiln/startup.py): silent unless enabled; a long conversion draws a bar on a
terminal and reports its time in a log."""

import io

from kiln import startup


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_phase_lines_only_while_enabled(capsys):
    startup.phase("silent in library use")
    with startup.enabled("kiln serve"):
        startup.phase("loading x")
    startup.phase("silent again")
    assert capsys.readouterr().err == "kiln serve: loading x\n"


def test_a_long_conversion_draws_a_bar_on_a_terminal_and_a_time_in_a_log(monkeypatch):
    monkeypatch.setattr(startup, "PROGRESS_AFTER_S", 0.0)  # every conversion counts as long
    for stream, bar in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr("sys.stderr", stream)
        with startup.enabled("kiln serve"):
            assert list(startup.progress(iter(range(4)), 4, "converting the weights", "matrices")) == [0, 1, 2, 3]
        text = stream.getvalue()
        assert text.startswith("kiln serve: converting the weights\n") and "kiln serve: done in" in text
        assert ("\r  [" + "#" * 30 + "] 4/4 matrices" in text) == bar, text
