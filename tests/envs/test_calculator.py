import pytest

from rlpipe.envs.base import TaskError
from rlpipe.envs.calculator import MAX_EXPR_CHARS, CalcError, Calculator, CalculatorParams, evaluate


@pytest.mark.parametrize("expr, value", [
    ("1234*5678", 7006652), ("1234+5678", 6912), ("(12+3)*4", 60), ("-5+2", -3), ("7//2", 3), ("7%4", 3),
    ("2**8", 256), (" 12 * 3 ", 36), ("0", 0),
])
def test_evaluate(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, words", [
    ("__import__('os').system('id')", "not Call"),
    ("open('/etc/passwd')", "not Call"),
    ("x+1", "not Name"),
    ("1.5*2", "not Constant"),          # floats are refused: the task is integer arithmetic
    ("True+1", "not Constant"),
    ("1/2", "not BinOp"),                # true division is not integer arithmetic
    ("9**9**9", "exponent"),             # would take forever and all memory
    ("2**-1", "exponent"),
    ("(10**8)**8*10**8*10**8", "too large"),
    ("1//0", "division by zero"), ("1%0", "division by zero"),
    ("1+", "cannot parse"), ("1\x002", "cannot parse"), ("1" * (MAX_EXPR_CHARS + 1), "longer than"),
    ("[1]*3", "not List"), ("(1).__class__", "not Attribute"), ("lambda: 1", "not Lambda"),
])
def test_evaluate_refuses_anything_but_bounded_integer_arithmetic(expr, words):
    with pytest.raises(CalcError, match=words):
        evaluate(expr)


def _env(**params):
    return Calculator(CalculatorParams(**params))


def test_an_episode_solved_with_the_tool():
    env = _env()
    assert env.reset({"expression": "1234*5678"}, seed=0) == "1234*5678"
    r = env.step("calc(1234*5678)")
    assert (r.observation, r.reward, r.done, r.info) == ("=7006652", 0.0, False, {"tool": "calc", "tool_error": False})
    r = env.step("answer(7006652)")
    assert (r.observation, r.reward, r.done) == ("correct", 1.0, True)


# "+-7006652" and "²" once crashed the environment (str.isdigit() passed them, int() refused them): the
# model's text must never become an environment error.
@pytest.mark.parametrize("answer", ["7006653", "seven", "", "7006652.0", "07006652x", "+-7006652", "²", "٣"])
def test_a_wrong_or_unreadable_answer_scores_0_and_ends(answer):
    env = _env()
    env.reset({"expression": "1234*5678"}, seed=0)
    r = env.step(f"answer({answer})")
    assert (r.reward, r.done, r.observation) == (0.0, True, "wrong")


@pytest.mark.parametrize("action, observation", [
    ("calc(1/0)", "error: only integers"),
    ("calc(1//0)", "error: division by zero"),
    ("search(weather)", "error: unknown tool 'search'"),
    ("the answer is 3", "error: expected NAME(ARGUMENT)"),
])
def test_model_mistakes_are_observations_and_the_episode_goes_on(action, observation):
    env = _env()
    env.reset({"expression": "2+2"}, seed=0)
    r = env.step(action)
    assert r.observation.startswith(observation) and not r.done and r.reward == 0.0 and r.info["tool_error"]
    assert env.step("answer(4)").reward == 1.0


def test_drawn_problems_follow_the_params_and_the_seed():
    env = _env(digits=3, ops=["*"])
    drawn = {env.reset({}, seed=s) for s in range(20)}
    assert len(drawn) > 15 and all(len(a) == 3 and len(b) == 3 for a, b in (d.split("*") for d in drawn))
    assert env.reset({}, seed=7) == _env(digits=3, ops=["*"]).reset({}, seed=7)


def test_a_bad_task_is_the_tasks_fault():
    with pytest.raises(TaskError, match="task field 'expression'"):
        _env().reset({"expression": "import os"}, seed=0)


def test_signed_answers_are_read():
    env = _env()
    env.reset({"expression": "3-5"}, seed=0)
    assert env.step("answer(-2)").reward == 1.0


def test_params_are_checked():
    with pytest.raises(ValueError, match="not supported"):
        CalculatorParams(ops=["/"])


def test_partial_credit_shapes_a_wrong_answer_but_success_stays_exact():
    from rlpipe.envs import EnvSpec, Episode
    from rlpipe.envs.metrics import episode_metrics

    spec = EnvSpec(env="calculator", params={"partial_credit": 0.5})
    rewards = {}
    episodes = []
    for answer in ("7006652", "7006000", "7106652", "9", "70066521"):
        ep = Episode(spec.make(), {"expression": "1234*5678"}, 0, spec.limits)
        ep.start()
        ep.act(f"answer({answer})")
        rewards[answer] = ep.reward
        episodes.append(ep)
    assert rewards == {"7006652": 1.0, "7006000": 0.5 * 4 / 7, "7106652": 0.5 * 1 / 7, "9": 0.0, "70066521": 0.5 * 7 / 8}
    assert episode_metrics(episodes)["episode/success_share"] == 0.2  # only the exact answer
    plain = EnvSpec(env="calculator").make()
    plain.reset({"expression": "2+2"}, 0)
    assert plain.step("answer(5)").reward == 0.0
