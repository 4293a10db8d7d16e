"""The one registry class (:mod:`rlpipe.registry`): register by name, look up with an error that lists the
valid names and the fix, list; a name registered twice is an error."""

import pytest

from rlpipe.registry import Registry


def test_register_returns_the_item_and_get_finds_it():
    reg: Registry = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    assert b() == "b" and reg.get("b") is b
    assert reg.add("a", len) is len
    assert reg.names() == ["a", "b"] == list(reg) and len(reg) == 2
    assert "a" in reg and "c" not in reg


def test_an_unknown_name_lists_the_valid_ones_and_the_fix():
    reg: Registry = Registry("widget", fix="register one with @register_widget")
    reg.add("beta", 2)
    reg.add("alpha", 1)
    with pytest.raises(KeyError, match=r"unknown widget 'gamma'; valid: alpha, beta; register one with @register_widget"):
        reg.get("gamma")
    with pytest.raises(KeyError, match="valid: none"):
        Registry("widget").get("x")


def test_registering_a_name_twice_is_an_error_naming_both():
    reg: Registry = Registry("widget")

    @reg.register("x")
    def first():
        pass

    def second():
        pass

    with pytest.raises(ValueError, match=r"widget 'x' is already registered \(.*first\); give .*second another name"):
        reg.register("x")(second)
    assert reg.get("x") is first


def test_a_copy_takes_registrations_without_changing_the_original():
    reg: Registry = Registry("widget", fix="f")
    reg.add("a", 1)
    other = reg.copy()
    other.add("b", 2)
    assert reg.names() == ["a"] and other.names() == ["a", "b"] and other.kind == "widget" and other.fix == "f"
