"""The environment registry (:mod:`rlpipe.envs.base`): registration by name, with tools and ``tool_free``."""

import pytest

from rlpipe.envs import env_class, env_names, register_env, tool_free_envs


def test_builtins_are_registered_with_their_tools():
    assert {"calculator", "guess"} <= set(env_names())
    assert env_class("calculator").tools == ("calc",) and env_class("guess").version == "1"


def test_tool_free_is_declared_at_registration():
    assert env_class("calculator").tool_free and not env_class("guess").tool_free
    assert "calculator" in tool_free_envs() and "guess" not in tool_free_envs()


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError, match="unknown environment 'chess'; valid: .*calculator.*guess.*@register_env"):
        env_class("chess")


def test_registering_a_name_twice_is_an_error_and_leaves_the_class_alone():
    other = type("Other", (), {})
    with pytest.raises(ValueError, match="environment 'calculator' is already registered"):
        register_env("calculator", "2")(other)
    assert env_class("calculator").version == "1" and not hasattr(other, "version")
