"""TextStream: generated tokens become text that is safe to show, whole characters only, stop strings held back."""

from __future__ import annotations

from worker.engine.sampling import TextStream


class Pieces:
    """A vocabulary of byte pieces, as a tokenizer's detokenize gives them."""

    def __init__(self, pieces: dict[int, bytes]) -> None:
        self.pieces = pieces

    def detokenize(self, tokens: list[int], prev_tokens: list[int] | None = None, special: bool = False) -> bytes:
        return b"".join(self.pieces[t] for t in tokens)


VOCAB = Pieces({1: b"Hello", 2: b" wor", 3: b"ld", 4: b"\xc3", 5: b"\xa9", 6: b" ST", 7: b"OP", 8: b" S", 9: b"!"})


def test_text_comes_out_as_it_is_made() -> None:
    s = TextStream(VOCAB)
    assert [s.push(t) for t in (1, 2, 3)] == ["Hello", " wor", "ld"]
    assert s.flush() == "" and s.text == "Hello world"


def test_a_character_split_across_tokens_waits_for_its_last_byte() -> None:
    s = TextStream(VOCAB)
    assert s.push(4) == "" and s.push(5) == "é"


def test_the_start_of_a_stop_string_is_held_until_it_is_clearly_not_one() -> None:
    s = TextStream(VOCAB, stop=[" STOP"])
    assert s.push(1) == "Hello"
    assert s.push(8) == "", "' S' could begin ' STOP'"
    assert s.push(9) == " S!"
    assert not s.stopped


def test_a_stop_string_ends_the_text_just_before_it() -> None:
    s = TextStream(VOCAB, stop=[" STOP"])
    out = [s.push(t) for t in (1, 6, 7)]
    assert out == ["Hello", "", ""] and s.stopped and s.text == "Hello"


def test_what_is_held_back_comes_out_when_generation_ends_without_a_stop() -> None:
    s = TextStream(VOCAB, stop=[" STOP"])
    s.push(1)
    s.push(6)
    assert s.flush() == " ST" and s.text == "Hello ST"
