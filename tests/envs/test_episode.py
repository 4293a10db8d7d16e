import pytest

from rlpipe.envs import EnvLimits, Episode, StepResult, completeness_problems
from rlpipe.envs.calculator import Calculator, CalculatorParams


class Scripted:
    """An environment that does what the test says, including failing."""

    name = "scripted"

    def __init__(self, results=(), reset_error=None, reset_value="start"):
        self.results, self.reset_error, self.reset_value = list(results), reset_error, reset_value

    def reset(self, task, seed):
        if self.reset_error:
            raise self.reset_error
        return self.reset_value

    def step(self, action):
        r = self.results.pop(0)
        if isinstance(r, BaseException):
            raise r
        return r


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_finished_episode_sums_its_step_rewards_and_records_timing():
    clock = FakeClock()
    env = Scripted([StepResult("a", 0.25), StepResult("b", 0.5, done=True)])
    ep = Episode(env, {}, 0, EnvLimits(), clock=clock)
    assert ep.start() == "start"
    assert ep.act("x") == "a"
    assert ep.act("y") is None
    assert (ep.status, ep.done, ep.truncated, ep.reward) == ("ok", True, False, 0.75)
    assert ep.record() == [{"action": "x", "observation": "a", "reward": 0.25, "env_s": 0.0, "info": "{}"},
                           {"action": "y", "observation": "b", "reward": 0.5, "env_s": 0.0, "info": "{}"}]
    assert all(s.env_s == 0.0 for s in ep.steps)
    with pytest.raises(RuntimeError, match="over"):
        ep.act("z")


def test_max_steps_truncates_and_keeps_the_episode():
    ep = Episode(Scripted([StepResult("o")] * 3), {}, 0, EnvLimits(max_steps=3))
    ep.start()
    assert [ep.act("a") for _ in range(3)] == ["o", "o", None]
    assert (ep.status, ep.truncated, ep.reward) == ("ok", True, 0.0) and "max_steps=3" in ep.reason


def test_the_episode_clock_truncates_after_the_step_that_ran_past_it():
    clock = FakeClock()

    class Slow(Scripted):
        def step(self, action):
            clock.t += 40
            return StepResult("o")

    ep = Episode(Slow(), {}, 0, EnvLimits(episode_timeout_s=100), clock=clock)
    ep.start()
    assert [ep.act("a") for _ in range(3)] == ["o", "o", None]  # 40, 80, then 120 s > 100
    assert ep.truncated and len(ep.steps) == 3 and "episode_timeout_s=100" in ep.reason


@pytest.mark.parametrize("env, words", [
    (Scripted(reset_error=OSError("disk gone")), "reset failed: OSError: disk gone"),
    (Scripted(reset_value=None), "reset returned NoneType"),
    (Scripted([StepResult("o"), ZeroDivisionError("bug")]), "step 2 failed: ZeroDivisionError: bug"),
    (Scripted([("o", 1.0, True, {})]), "step 1 returned tuple"),
    (Scripted([StepResult("o", float("nan"))]), "reward nan, not a finite number"),
    (Scripted([StepResult("o", "1")]), "reward '1', not a finite number"),
    (Scripted([StepResult(None)]), "observation of type NoneType"),
    (Scripted([StepResult("o", info=["tool"])]), "info of type list"),
])
def test_an_environment_that_fails_gives_error_never_reward_0(env, words):
    ep = Episode(env, {}, 0, EnvLimits())
    obs = ep.start()
    while obs is not None:
        obs = ep.act("a")
    assert ep.status == "error" and ep.reward is None and words in ep.reason and "environment scripted" in ep.reason


def test_a_task_the_environment_cannot_run_is_error():
    ep = Episode(Calculator(CalculatorParams()), {"expression": "os.system('x')"}, 0, EnvLimits())
    assert ep.start() is None and ep.status == "error" and "task field 'expression'" in ep.reason


def test_tool_calls_and_errors_are_counted():
    ep = Episode(Calculator(CalculatorParams()), {"expression": "12*34"}, 0, EnvLimits())
    ep.start()
    for a in ("calc(12*)", "calc(12*34)", "answer(408)"):
        ep.act(a)
    assert (ep.tool_calls, ep.tool_errors, ep.reward) == (2, 1, 1.0)


STEP = {"action": "calc(1)", "observation": "=1", "reward": 0.0}


@pytest.mark.parametrize("steps, done, truncated, words", [
    ([STEP, STEP | {"reward": 1.0}], True, False, None),
    ([STEP] * 3, False, True, None),
    ([STEP | {"observation": None}], True, False, "step 0: no observation"),
    ([{"reward": 0.0}], True, False, "step 0: no action / observation"),
    ([STEP | {"reward": float("nan")}], True, False, "not a finite number"),
    ([STEP | {"reward": None}], True, False, "not a finite number"),
    ([STEP] * 5, False, True, "more than max_steps=4"),
    ([STEP], False, False, "cut short abnormally"),
    ([STEP], True, True, "both done and truncated"),
    ([], True, False, "no steps"),
])
def test_completeness_check(steps, done, truncated, words):
    problems = completeness_problems(steps, done=done, truncated=truncated, max_steps=4)
    if words is None:
        assert problems == []
    else:
        assert any(words in p for p in problems), problems


def test_a_recorded_episode_passes_its_own_check():
    ep = Episode(Calculator(CalculatorParams()), {"expression": "12*34"}, 0, EnvLimits(max_steps=2))
    ep.start()
    ep.act("calc(12*34)")
    ep.act("calc(1)")
    assert ep.truncated
    assert completeness_problems(ep.record(), done=ep.done, truncated=ep.truncated, max_steps=2) == []


def test_experts_solve_their_environments_from_observations_alone():
    from rlpipe.envs import EnvSpec
    from rlpipe.envs.experts import demonstrate

    calc = [demonstrate(EnvSpec(env="calculator"), {}, s) for s in range(20)]
    assert all(e.done and e.reward == 1.0 and len(e.steps) == 2 and e.tool_calls == 1 for e in calc)
    guess = [demonstrate(EnvSpec(env="guess"), {"secret": k}, 0) for k in range(1, 101)]
    assert all(e.done and e.reward == 1.0 for e in guess)
    assert sum(len(e.steps) for e in guess) / 100 == pytest.approx(5.8)
    with pytest.raises(KeyError, match="no expert"):
        demonstrate(EnvSpec.model_construct(env="chess"), {}, 0)


def test_a_demonstrator_without_the_tool_answers_at_once_and_exactly():
    from rlpipe.envs import EnvSpec
    from rlpipe.envs.experts import demonstrate

    ep = demonstrate(EnvSpec(env="calculator"), {"expression": "1234*5678"}, 0, use_tool=False)
    assert ep.done and ep.reward == 1.0 and len(ep.steps) == 1 and ep.tool_calls == 0
    assert ep.steps[0].action == "answer(7006652)"
    with pytest.raises(ValueError, match="no tool to leave out"):
        demonstrate(EnvSpec(env="guess"), {"secret": 3}, 0, use_tool=False)


@pytest.mark.parametrize("share", [1.0, 0.5, 0.3, 0.25, 0.01])
def test_the_tool_share_of_demonstrations_is_exact_in_every_prefix(share):
    from rlpipe.envs.experts import uses_tool

    picks = [uses_tool(k, share) for k in range(2000)]
    for n in (1, 7, 10, 333, 2000):
        assert sum(picks[:n]) == int(n * share + 0.5), n
    assert all(picks) == (share == 1.0)


def test_demonstrations_mix_the_two_habits_at_the_tool_share():
    from rlpipe.envs import EnvSpec
    from rlpipe.envs.experts import demonstrations

    tasks = [({"expression": f"{a}*{a + 7}"}, 0) for a in range(100, 104)]
    eps = demonstrations(EnvSpec(env="calculator"), tasks, 10, tool_share=0.3)
    assert [e.task for e in eps] == [t for t, _ in tasks] * 2 + [t for t, _ in tasks[:2]]  # tasks reused in order
    assert sum(e.tool_calls for e in eps) == 3 and all(e.reward == 1.0 for e in eps)
    assert [len(e.steps) for e in eps] == [1, 2, 1, 1, 2, 1, 1, 1, 2, 1]
    with pytest.raises(ValueError, match="at least one task"):
        demonstrations(EnvSpec(env="calculator"), [], 3)
