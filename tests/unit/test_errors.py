"""gclip.errors: one-line messages, and classes that refine the builtins; the one error every
rank raises, built from what each rank reported (``engine.agreed_error``)."""

from __future__ import annotations

import pytest

from gclip import GclipError, GclipTypeError, GclipValueError, NonFiniteNormError
from gclip._lab.lines import exception_line
from gclip.engine import agreed_error
from gclip.errors import one_line


def test_the_class_of_the_failing_rank_is_kept():
    for kind, cls in (
        ("GclipTypeError", GclipTypeError),
        ("TypeError", GclipTypeError),
        ("ValueError", GclipValueError),
        ("NonFiniteNormError", NonFiniteNormError),
    ):
        err = agreed_error([(None, "a"), ((kind, "bad"), "a")], mismatch=False)
        assert type(err) is cls and str(err) == "rank 1 of 2: bad"


def test_an_error_of_another_kind_says_its_name():
    err = agreed_error([(("MemoryError", "cannot allocate"), None)] * 3, mismatch=False)
    assert type(err) is GclipError and str(err) == "ranks 0, 1, 2 of 3: MemoryError: cannot allocate"


def test_ranks_failing_differently_are_all_named():
    reports = [(("GclipValueError", "x"), None), (None, None), (("GclipTypeError", "y"), None)]
    err = agreed_error(reports, mismatch=False)
    assert str(err) == "rank 0 of 3 (and rank 2 with other errors): x"


def test_a_mismatch_names_each_rank_and_its_arguments():
    err = agreed_error([(None, "p=2"), (None, "p=1"), (None, "p=2")], mismatch=True)
    assert isinstance(err, GclipValueError)
    assert str(err) == "ranks disagree on the arguments (ranks 0, 2: p=2; rank 1: p=1)"


def test_messages_are_one_line():
    assert one_line("a\n  b\tc") == "a b c"
    assert exception_line(ValueError("bad\nvalue")) == "ValueError: bad value"
    assert exception_line(KeyError()) == "KeyError"
    assert exception_line(GclipValueError("x" * 50), limit=10, with_type=False) == "xxxxxxx..."


@pytest.mark.parametrize("cls", [GclipTypeError, GclipValueError, NonFiniteNormError])
def test_every_error_is_a_gclip_error_and_the_builtin_it_refines(cls):
    assert issubclass(cls, GclipError)
    assert issubclass(GclipTypeError, TypeError) and issubclass(GclipValueError, ValueError)
    assert issubclass(NonFiniteNormError, FloatingPointError)
