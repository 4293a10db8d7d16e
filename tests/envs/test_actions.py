import pytest

from rlpipe.envs.actions import MAX_ACTION_CHARS, Action, InvalidAction, format_action, parse_action, parse_int


@pytest.mark.parametrize("text, name, argument", [
    ("calc(12*34)", "calc", "12*34"),
    ("  answer(408)\n", "answer", "408"),
    ("calc((12+3)*4)", "calc", "(12+3)*4"),       # the argument runs to the last ")"
    ("guess( 50 )", "guess", "50"),
    ("answer()", "answer", ""),
])
def test_calls_parse(text, name, argument):
    assert parse_action(text) == Action(name, argument)


@pytest.mark.parametrize("text", [
    "", "408", "calc 12*34", "calc(12*34", "I think calc(1+2)", "calc(1+2) and more", "Calc(1)", "calc(1)(2",
    "x" * (MAX_ACTION_CHARS + 1),
])
def test_anything_else_is_invalid_with_a_message_for_the_model(text):
    with pytest.raises(InvalidAction, match="^error: "):
        parse_action(text)


def test_format_is_the_inverse_of_parse():
    assert parse_action(format_action("calc", "(1+2)*3")) == Action("calc", "(1+2)*3")


@pytest.mark.parametrize("text, value", [("12", 12), ("-3", -3), ("+7", 7), (" 40 ", 40), ("007", 7),
                                         ("+-5", None), ("--5", None), ("²", None), ("1.0", None), ("", None), ("1e3", None)])
def test_parse_int_never_raises_on_model_text(text, value):
    assert parse_int(text) == value
