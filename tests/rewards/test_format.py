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
        ("", SCHEMA, "ok", 0.0, "empty"),
        ("{}", '{"type": 5}', "error", None, "invalid schema"),
        ("{}", "{not a schema", "error", None, "not a JSON schema"),
    ],
)
def test_json_schema_verdicts(response, schema, status, reward, reason):
    res = get_verifier("json")(response, schema)
    assert (res.status, res.reward) == (status, reward), res.reason
    assert reason in res.reason


# The verdict rule: a rule or schema that cannot be read or applied is the reference's fault
# (status "error", no reward); whatever the response does wrong is the model's (0 / "ok").
BROKEN_RULES = [
    ("format", None, "no rule"),
    ("format", "", "no rule"),
    ("format", "{}", "empty rule"),
    ("format", "not json", "not JSON"),
    ("format", '["answer"]', "not an object"),
    ("format", json.dumps({"tagz": ["answer"]}), "unknown key"),
    ("format", json.dumps({"tags": "answer"}), "tags must be a non-empty list"),
    ("format", json.dumps({"tags": []}), "tags must be a non-empty list"),
    ("format", json.dumps({"tags": ["<answer>"]}), "not tag names"),
    ("format", json.dumps({"tags": ["answer", "answer"]}), "listed twice"),
    ("format", json.dumps({"regex": "("}), "does not compile"),
    ("format", json.dumps({"regex": 5}), "regex must be a non-empty string"),
    ("format", json.dumps({"answer": ["46"]}), "answer must be a string or a number"),
    ("json", "{not a schema", "not a JSON schema"),
    ("json", "5", "invalid schema"),
    ("json", '{"type": 5}', "invalid schema"),
    ("json", '{"type": "object", "required": "name"}', "invalid schema"),
    ("json", '{"$ref": "#/definitions/missing"}', "invalid schema"),
]


@pytest.mark.parametrize("verifier,reference,problem", BROKEN_RULES)
@pytest.mark.parametrize("response", ['<answer>46</answer>', '{"name": "Ada", "age": 36}', "", "garbage"])
def test_a_broken_rule_is_an_error_never_a_zero(verifier, reference, problem, response):
    v = get_verifier(verifier)
    res = v(response, reference)
    assert (res.status, res.reward) == ("error", None), res
    msg = v.check_reference(reference)
    assert msg and problem in msg, msg  # `rlpipe data validate` finds the same row before training


@pytest.mark.parametrize(
    "verifier,reference",
    [
        ("format", TAGS),
        ("format", TAGS_ANSWER),
        ("format", json.dumps({"regex": "[A-Z]{3}-\\d{3}"})),
        ("format", json.dumps({"answer": 46})),
        ("json", SCHEMA),
        ("json", None),
        ("json", "true"),
        ("json", '{"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}'),
    ],
)
def test_usable_rules_pass_the_reference_check(verifier, reference):
    assert get_verifier(verifier).check_reference(reference) is None


@pytest.mark.parametrize(
    "verifier,response,reference,reward",
    [
        ("format", "no tags at all", TAGS, 0.0),
        ("format", "<think>x</think>", TAGS, 0.0),
        ("format", "<think>x</think><answer>45</answer>", TAGS_ANSWER, 0.0),
        ("format", "46", json.dumps({"answer": 46}), 1.0),
        ("json", "{'single': 'quotes'}", SCHEMA, 0.0),
        ("json", '{"name": 1, "age": 36}', SCHEMA, 0.0),
        ("json", '{"a": "x"}', '{"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}', 0.0),
        ("json", '{"a": 3}', '{"$defs": {"n": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/n"}}}', 1.0),
    ],
)
def test_model_faults_are_judged_ok(verifier, response, reference, reward):
    res = get_verifier(verifier)(response, reference)
    assert (res.status, res.reward) == ("ok", reward), res


def test_a_schema_that_breaks_only_on_some_answers_is_an_error():
    schema = json.dumps({"properties": {"a": {"$ref": "#/$defs/nowhere"}}})
    assert get_verifier("json")('{"b": 1}', schema).status == "ok"  # the broken part is never reached
    res = get_verifier("json")('{"a": 1}', schema)
    assert (res.status, res.reward) == ("error", None) and "cannot be applied" in res.reason
