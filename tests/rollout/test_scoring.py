"""A rollout batch scored (rlpipe.rollout.scoring.score_batch) with a stand-in verifier pool: the verdicts,
the circuit breaker over the run's history, the alerts."""

import logging
from types import SimpleNamespace

import pytest

from rlpipe.config import RunConfig
from rlpipe.history import RunHistory
from rlpipe.rewards.base import VerifyResult
from rlpipe.rewards.guards import RewardCircuitOpen
from rlpipe.rollout.scoring import score_batch
from tests.rollout.test_batch import row, table


class Pool:
    size, restarts, last_problem = 2, 1, None

    def __init__(self, verdicts):
        self.verdicts = verdicts

    def healthy(self):
        return True

    def score(self, items):
        return [self.verdicts[i.response] for i in items]


def _svc(verdicts):
    return SimpleNamespace(pool=Pool(verdicts), reward_model=None, ground_truth={"a": "1", "b": "2"}, prompts={})


BATCH = table([row("a", None, 1, status="skipped", idx=0), row("a", None, 2, status="skipped", idx=1),
               row("b", None, 3, status="skipped", idx=0), row("b", None, 4, status="skipped", idx=1)])


def test_verdicts_metrics_and_alerts(tmp_path, caplog):
    svc = _svc({"x": VerifyResult(1.0, "ok"), "xx": VerifyResult(0.0, "ok"), "xxx": VerifyResult(1.0, "ok"),
                "xxxx": VerifyResult(None, "timeout", "slow")})
    svc.pool.last_problem = "verifier service answered 503 once"
    with caplog.at_level(logging.WARNING, "t"):
        scored, stats, alerts = score_batch(RunConfig(), svc, RunHistory(tmp_path / "h.jsonl"), BATCH, 0, None,
                                            logging.getLogger("t"))
    assert scored.column("reward").to_pylist() == [1.0, 0.0, 1.0, None]
    assert stats["status_ok"] == 0.75 and stats["status_timeout"] == 0.25 and stats["accuracy"] == 0.5
    assert stats["groups_with_signal"] == 1.0 and stats["verifier/restarts"] == 1.0 and stats["verify_s"] >= 0
    assert alerts == ["verifier service answered 503 once"] and "ALERT iteration 0: verifier service" in caplog.text


def test_the_circuit_breaker_reads_the_runs_recent_iterations(tmp_path):
    broken = _svc({t: VerifyResult(None, "error", "no sandbox") for t in ("x", "xx", "xxx", "xxxx")})
    history = RunHistory(tmp_path / "h.jsonl")
    config = RunConfig()  # max_invalid_share 0.5, max_invalid_iterations 3
    for k, share in enumerate((0.9, 0.9)):
        history.add(k, {"invalid_share": share})
    with pytest.raises(RewardCircuitOpen, match="iteration 2: 100% of samples not scored 'ok'.* 3 iterations in a row"):
        score_batch(config, broken, history, BATCH, 2, None)
    history.add(1, {"invalid_share": 0.1})  # the iteration before was fine: the streak is 1, the batch goes on
    _, stats, alerts = score_batch(config, broken, history, BATCH, 2, None)
    assert stats["status_error"] == 1.0 and any("only 0/4 samples could be scored" in a for a in alerts)
