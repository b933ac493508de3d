"""Stop strings on a streamed output (tinyvllm/sample/stop.py): the text is cut where a stop string first ends, a
tail that may still become one is held back, and released when the stream ends without one."""

from __future__ import annotations

from tinyvllm.sample.stop import StopStringChecker


def stream(checker: StopStringChecker, pieces: list[str]) -> tuple[list[str], bool]:
    shown = []
    for piece in pieces:
        text, stopped = checker.feed(piece)
        shown.append(text)
        if stopped:
            return shown, True
    return shown, False


def test_a_stop_string_split_across_pieces_is_found():
    checker = StopStringChecker(["</answer>"])
    shown, stopped = stream(checker, ["The answer is 42</", "answer>\n", "never seen"])
    assert shown == ["The answer is 42", ""] and stopped and checker.stop_str == "</answer>"


def test_the_held_back_tail_is_released_at_the_end():
    checker = StopStringChecker(["</answer>"])
    shown, stopped = stream(checker, ["a </", "ans"])
    assert shown == ["a ", ""] and not stopped
    assert checker.flush() == "</ans" and not checker.stopped


def test_the_stop_string_that_ends_first_wins_and_may_be_kept():
    checker = StopStringChecker(["xyz", "ab"], include_in_output=True)
    shown, stopped = stream(checker, ["0 a", "b xyz"])
    assert "".join(shown) == "0 ab" and stopped and checker.stop_str == "ab"
    both = StopStringChecker(["abc", "bc"])  # end together: the one that starts earlier, so none of it leaks
    assert both.feed("xabcd") == ("x", True) and both.stop_str == "abc"
