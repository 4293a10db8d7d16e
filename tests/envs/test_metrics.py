import pytest

from rlpipe.envs import EnvLimits, Episode
from rlpipe.envs.calculator import Calculator, CalculatorParams
from rlpipe.envs.metrics import episode_metrics


def _episode(actions, expression="12*34", max_steps=3):
    ep = Episode(Calculator(CalculatorParams()), {"expression": expression}, 0, EnvLimits(max_steps=max_steps))
    if ep.start() is not None:
        for a in actions:
            if ep.act(a) is None:
                break
    return ep


def test_metrics_by_hand():
    eps = [
        _episode(["calc(12*34)", "answer(408)"]),          # success in 2 steps, 1 tool call
        _episode(["answer(408)"]),                          # success in 1 step, no tool
        _episode(["calc(12*)", "calc(1)", "calc(2)"]),     # truncated after 3 steps, 3 tool calls, 1 tool error
        _episode([], expression="import os"),              # environment could not start: error
    ]
    m = episode_metrics(eps)
    assert m["episode/count"] == 4
    assert m["episode/error_share"] == 0.25 and m["episode/truncated_share"] == 0.25
    assert m["episode/success_share"] == 0.5
    assert m["episode/reward_mean"] == pytest.approx(2 / 3)
    assert m["episode/steps_mean"] == 2.0 and m["episode/steps_max"] == 3
    assert m["episode/tool_calls_per_episode"] == pytest.approx(4 / 3)
    assert m["episode/tool_use_share"] == pytest.approx(2 / 3)  # of the judged episodes, those with a call
    assert m["episode/tool_error_rate"] == pytest.approx(1 / 6)
    assert (m["episode/length/1"], m["episode/length/2"], m["episode/length/3"]) == (0.25, 0.25, 0.25)
    assert 0 <= m["episode/env_step_p50_s"] <= m["episode/env_step_p99_s"]


def test_a_wrong_answer_is_no_success_and_no_episodes_is_no_crash():
    assert episode_metrics([_episode(["answer(1)"])])["episode/success_share"] == 0.0
    assert episode_metrics([]) == {"episode/count": 0.0}
