import json

import pytest

from rlpipe.rewards import get_verifier

TAGS = json.dumps({"tags": ["think", "answer"]})
TAGS_ANSWER = json.dumps({"tags": ["think", "answer"], "answer": "46"})


@pytest.mark.parametrize(
    "response,rule,status,reward",
    [
        ("<think>12+34</think><answer>46</answer>", TAGS, "ok", 1.0),
        ("  <think>a</think>\n<answer>46</answer>\n", TAGS, "ok", 1.0),
        ("<answer>46</answer><think>x</think>", TAGS, "ok", 0.0),  # wrong order
        ("<think>x</think><answer>46</answer><answer>47</answer>", TAGS, "ok", 0.0),  # answer twice
        ("<think>x</think><answer>46", TAGS, "ok", 0.0),  # not closed
        ("<think></think><answer>46</answer>", TAGS, "ok", 0.0),  # empty
        ("<think>x</think><answer>46</answer> and more", TAGS, "ok", 0.0),  # trailing text
        ("<think>x</think><answer> 46 </answer>", TAGS_ANSWER, "ok", 1.0),
        ("<think>x</think><answer>47</answer>", TAGS_ANSWER, "ok", 0.0),
        ("ABC-123", json.dumps({"regex": "[A-Z]{3}-\\d{3}"}), "ok", 1.0),
        ("ABC-1234", json.dumps({"regex": "[A-Z]{3}-\\d{3}"}), "ok", 0.0),  # full match, not search
        ("x", json.dumps({"regex": "("}), "error", None),
        ("x", "not json", "error", None),
        ("x", json.dumps({"tagz": []}), "error", None),
    ],
)
def test_format_verdicts(response, rule, status, reward):
    res = get_verifier("format")(response, rule)
    assert (res.status, res.reward) == (status, reward), res.reason


SCHEMA = json.dumps({
    "type": "object", "required": ["name", "age"],
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "additionalProperties": False,
})


@pytest.mark.parametrize(
    "response,schema,status,reward,reason",
    [
        ('{"name": "Ada", "age": 36}', SCHEMA, "ok", 1.0, ""),
        ('Here you go:\n```json\n{"name": "Ada", "age": 36}\n```', SCHEMA, "ok", 1.0, ""),
        ('{"name": "Ada"}', SCHEMA, "ok", 0.0, "'age' is a required property"),
        ('{"name": "Ada", "age": -1}', SCHEMA, "ok", 0.0, "age:"),
        ('{"name": "Ada", "age": "36"}', SCHEMA, "ok", 0.0, "age:"),
        ('{"name": "Ada", "age": 36, "x": 1}', SCHEMA, "ok", 0.0, "Additional properties"),
        ("{'name': 'Ada'}", SCHEMA, "ok", 0.0, "not JSON"),
        ("[1, 2", None, "ok", 0.0, "not JSON"),
        ("[1, 2]", None, "ok", 1.0, ""),
        ("", SCHEMA, "unparseable", None, "empty"),
        ("{}", '{"type": 5}', "error", None, "invalid schema"),
        ("{}", "{not a schema", "error", None, "not a JSON schema"),
    ],
)
def test_json_schema_verdicts(response, schema, status, reward, reason):
    res = get_verifier("json")(response, schema)
    assert (res.status, res.reward) == (status, reward), res.reason
    assert reason in res.reason
