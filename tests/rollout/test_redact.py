"""data.redact at the trajectory writer: what a rollout writes, read back from a real (local) store."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rlpipe.config import RunConfig
from rlpipe.resume import config_changes, resume_fingerprint
from rlpipe.rollout.redact import redact_trajectories, write_trajectories
from rlpipe.storage import TRAJECTORY_SCHEMA, open_store
from rlpipe.storage.layout import stage_prefix
from rlpipe.training.tiny import build_char_tokenizer

EMAIL = "jane.doe@uni-bonn.de"
PROMPT = "Who wrote 12+34=?"
RESPONSE = f"Ask {EMAIL}; 12+34=46"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _table(tok, response=RESPONSE, prompt=PROMPT):
    ids = tok.encode(response, add_special_tokens=False)
    row = {"run_id": "r", "iteration": 1, "prompt_id": "q1", "sample_index": 0, "policy_version": "ab" * 32,
           "prompt_token_ids": tok.encode(prompt, add_special_tokens=False), "response_token_ids": ids,
           "response_text": response, "logprobs": [-0.5] * len(ids), "loss_mask": [1] * len(ids), "steps": None,
           "reward": None, "reward_status": "skipped", "reward_reason": "not scored yet", "verifier": "math",
           "verifier_version": None, "isolation": None, "truncated": False, "generate_s": 0.1, "verify_s": None}
    return pa.Table.from_pylist([row, row | {"sample_index": 1, "response_text": "46",
                                             "response_token_ids": tok.encode("46"), "logprobs": [-0.1, -0.2],
                                             "loss_mask": [1, 1]}], schema=TRAJECTORY_SCHEMA)


def _write_and_read(tmp_path, tok, table, redact):
    store = open_store(str(tmp_path / "store"))
    prefix = stage_prefix("r", 1, "rollout", 0)
    write_trajectories(store, prefix, table, {"rows": table.num_rows}, redact=redact, tokenizer=tok)
    return store.read_stage(prefix, schema=TRAJECTORY_SCHEMA).to_pylist(), store.read_manifest(prefix)["meta"]


def test_flag_off_stores_the_text_as_generated(tmp_path, tok):
    rows, meta = _write_and_read(tmp_path, tok, _table(tok), redact=False)
    assert rows[0]["response_text"] == RESPONSE and EMAIL in tok.decode(rows[0]["response_token_ids"])
    assert "data/redacted_values" not in meta


def test_flag_on_nothing_of_the_address_reaches_the_store(tmp_path, tok):
    table = _table(tok)
    rows, meta = _write_and_read(tmp_path, tok, table, redact=True)
    first = rows[0]
    assert first["response_text"] == "Ask [EMAIL]; 12+34=46"
    ids = first["response_token_ids"]
    assert EMAIL not in tok.decode(ids) and "jane" not in tok.decode(ids)
    assert tok.decode(ids).endswith("; 12+34=46")  # the rest of the response, token for token
    padded = [i for i, t in enumerate(ids) if t == tok.pad_token_id]
    assert len(padded) == len(EMAIL) and first["loss_mask"] == [0 if i in padded else 1 for i in range(len(ids))]
    assert len(first["logprobs"]) == len(ids) == table.column("response_token_ids").to_pylist()[0].__len__()
    assert rows[1] == table.to_pylist()[1]  # a clean row is left as it was
    assert meta["data/redacted_values"] == 1 + len(EMAIL)
    for path in (tmp_path / "store").rglob("*"):
        assert not path.is_file() or EMAIL.encode() not in path.read_bytes()


def test_prompt_tokens_and_steps_are_redacted_too(tok):
    steps = [{"action": "lookup()", "observation": f"owner {EMAIL}", "reward": None, "env_s": 0.0, "info": "{}"}]
    table = _table(tok, response="46", prompt=f"{EMAIL} asks: 12+34=?").set_column(
        TRAJECTORY_SCHEMA.get_field_index("steps"), TRAJECTORY_SCHEMA.field("steps"), pa.array([steps, None], type=TRAJECTORY_SCHEMA.field("steps").type))
    out, _ = redact_trajectories(table, tok)
    row = out.to_pylist()[0]
    assert row["steps"][0]["observation"] == "owner [EMAIL]"
    assert tok.decode(row["prompt_token_ids"]).endswith(" asks: 12+34=?") and EMAIL not in tok.decode(row["prompt_token_ids"])
    assert row["loss_mask"] == [1, 1]  # prompt tokens carry no loss: nothing to mask in the response


def test_config_key_defaults_off_and_old_runs_resume_unchanged():
    cfg = RunConfig()
    assert cfg.data.redact is False
    old = {k: v for k, v in cfg.flat().items() if k != "data.redact"}  # a run recorded before the key existed
    assert config_changes(old, cfg.flat()) == []
    assert resume_fingerprint(cfg) != resume_fingerprint(RunConfig.model_validate({"data": {"redact": True}}))


def test_evaluation_samples_logged_to_mlflow_are_redacted_where_asked():
    from rlpipe.rollout.redact import redact_samples

    result = {"accuracy": 0.5, "n": 2, "samples": [
        {"prompt": f"mail {EMAIL}: 12+34=?", "response": "46", "ground_truth": "46", "correct": True},
        {"prompt": "7*6=?", "response": f"ask {EMAIL}", "ground_truth": "42", "correct": False}]}
    out = redact_samples(result, True)
    assert [s["prompt"] for s in out["samples"]] == ["mail [EMAIL]: 12+34=?", "7*6=?"]
    assert out["samples"][1]["response"] == "ask [EMAIL]" and out["samples"][0]["correct"] is True
    assert out["accuracy"] == 0.5 and result["samples"][0]["prompt"].startswith("mail jane")  # the input is untouched
    assert redact_samples(result, False) is result


def test_both_evaluations_go_through_it():
    import inspect

    import tasks.evaluate as ev
    import tasks.rl as rl

    assert "redact_samples(greedy_eval(" in inspect.getsource(rl.evaluate)
    assert "config.data.redact" in inspect.getsource(rl.evaluate)
    assert "redact_samples(greedy_eval(" in inspect.getsource(ev) and "config.data.redact)" in inspect.getsource(ev)
