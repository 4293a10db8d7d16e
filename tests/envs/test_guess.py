import statistics

import pytest

from rlpipe.envs import EnvLimits, Episode, TaskError
from rlpipe.envs.guess import Guess, GuessParams


def _bisect(episode: Episode, lo: int, hi: int) -> None:
    """The policy the environment rewards: halve the range after each answer."""
    obs = episode.start()
    while obs is not None:
        mid = (lo + hi) // 2
        obs = episode.act(f"guess({mid})")
        if obs == "higher":
            lo = mid + 1
        elif obs == "lower":
            hi = mid - 1


def test_feedback_by_hand():
    env = Guess(GuessParams())
    assert env.reset({"secret": 37}, seed=0) == "1-100"
    assert [env.step(f"guess({n})").observation for n in (50, 25, 37)] == ["lower", "higher", "correct"]


def test_halving_always_succeeds_and_needs_more_than_3_steps_on_average():
    steps = []
    for secret in range(1, 101):
        ep = Episode(Guess(GuessParams()), {"secret": secret}, 0, EnvLimits(max_steps=10))
        _bisect(ep, 1, 100)
        assert ep.status == "ok" and ep.done and ep.reward == 1.0 and not ep.truncated
        steps.append(len(ep.steps))
    assert max(steps) == 7 and statistics.mean(steps) == pytest.approx(5.8, abs=0.01)


def test_running_out_of_guesses_is_truncated_with_reward_0():
    ep = Episode(Guess(GuessParams()), {"secret": 99}, 0, EnvLimits(max_steps=3))
    ep.start()
    assert [ep.act("guess(1)") for _ in range(3)] == ["higher", "higher", None]
    assert (ep.status, ep.truncated, ep.reward) == ("ok", True, 0.0)


def test_step_penalty_is_a_per_step_reward():
    ep = Episode(Guess(GuessParams(step_penalty=0.1)), {"secret": 37}, 0, EnvLimits())
    _bisect(ep, 1, 100)
    assert [s.reward for s in ep.steps] == pytest.approx([-0.1, -0.1, 0.9]) and ep.reward == pytest.approx(0.7)


@pytest.mark.parametrize("action, words", [("guess(fifty)", "needs an integer"), ("guess(--5)", "needs an integer"),
                                           ("guess(²)", "needs an integer"), ("calc(1+1)", "unknown tool"), ("50", "expected")])
def test_bad_guesses_are_the_models_mistake(action, words):
    env = Guess(GuessParams())
    env.reset({"secret": 5}, seed=0)
    r = env.step(action)
    assert words in r.observation and not r.done and r.info["tool_error"]


@pytest.mark.parametrize("secret", [0, 101, "7", 7.0])
def test_a_secret_outside_the_range_is_the_tasks_fault(secret):
    with pytest.raises(TaskError, match="secret"):
        Guess(GuessParams()).reset({"secret": secret}, seed=0)


def test_drawn_secrets_depend_on_the_seed_only():
    env = Guess(GuessParams(lo=1, hi=1000))
    secrets = []
    for s in range(5):
        env.reset({}, seed=s)
        secrets.append(env.secret)
    again = Guess(GuessParams(lo=1, hi=1000))
    again.reset({}, seed=3)
    assert again.secret == secrets[3] and len(set(secrets)) == 5
