"""Importers of code datasets: HumanEval, MBPP, APPS and CodeContests, tests kept as published."""

from __future__ import annotations

import ast
import builtins
import json
import re
from typing import Any

from rlpipe.data.importers.rows import Row, RowError, fence, need, prompt_row

HUMANEVAL_INSTRUCTION = ("Complete the Python function below. Reply with the whole program (its imports, the "
                         "function's signature and its body) in one ```python code block.\n\n")
STDIO_INSTRUCTION = "Write a Python 3 program that reads the input from standard input and prints the answer."


def _helpers(prompt: str, entry_point: str) -> str:
    """The imports and top-level definitions of a HumanEval prompt other than the entry point, as source."""
    try:
        tree = ast.parse(prompt)
    except SyntaxError as e:
        raise RowError("prompt", f"is not Python ({e.msg}, line {e.lineno})", "give HumanEval's prompt as published") from None
    lines, parts = prompt.splitlines(), []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == entry_point:
            continue
        if isinstance(node, ast.Expr):  # a module docstring or stray expression: nothing a test needs
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        parts.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "\n\n".join(parts)


def convert_humaneval(row: Row, split: str) -> dict[str, Any]:
    """HumanEval {task_id, prompt, canonical_solution, test, entry_point}; the test is kept as published."""
    o = row.obj
    task_id, prompt, entry = need(o, "task_id"), need(o, "prompt"), need(o, "entry_point")
    canonical, test = need(o, "canonical_solution"), need(o, "test")
    if not re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", prompt, re.M):
        raise RowError("entry_point", f"{entry!r} is not defined by the prompt", "give the row as published")
    truth: dict[str, Any] = {"test": test, "entry_point": entry}
    setup = _helpers(prompt, entry)
    if setup:
        truth["test_setup_code"] = setup
    body = prompt + ("" if prompt.endswith("\n") else "\n")
    return prompt_row(row, split, "humaneval", task_id.replace("/", "-"), HUMANEVAL_INSTRUCTION + fence(body),
                      "code", json.dumps(truth, ensure_ascii=False), fence(prompt + canonical), "openai/humaneval")


# MBPP's own split by task id (Austin et al. 2021, §2.1): 1-10 few-shot prompts, 11-510 test, 511-600 validation.
def mbpp_split(task_id: int) -> str:
    return "test" if 11 <= task_id <= 510 else "validation" if 511 <= task_id <= 600 else "train"


def _shadowing_function(code: str, tests: list[str]) -> str | None:
    """A function of the canonical code that is named like a builtin and that the tests call, or None."""
    try:
        defined = {n.name for n in ast.parse(code).body if isinstance(n, ast.FunctionDef)}
    except SyntaxError:
        return None
    called = {m.group(1) for t in tests for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\(", t)}
    hits = sorted(defined & called & set(dir(builtins)))
    return hits[0] if hits else None


def convert_mbpp(row: Row, split: str) -> dict[str, Any]:
    """MBPP {task_id, text, code, test_list, test_setup_code, challenge_test_list} or the sanitized
    {task_id, prompt, code, test_imports, test_list}; the prompt ends with the first test, as MBPP's does."""
    o = row.obj
    text = o.get("text") if o.get("text") is not None else o.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise RowError("text", "missing or empty", "every MBPP row has 'text' ('prompt' in the sanitized variant): is FORMAT right?")
    tests = need(o, "test_list", list, "a list of assert statements")
    if not tests or not all(isinstance(t, str) for t in tests):
        raise RowError("test_list", "is empty or not a list of strings", "give MBPP's test_list as published")
    truth: dict[str, Any] = {"tests": tests}
    if isinstance(o.get("test_setup_code"), str) and o["test_setup_code"].strip():
        truth["test_setup_code"] = o["test_setup_code"]
    if o.get("test_imports"):
        truth["test_imports"] = list(o["test_imports"])
    task_id = need(o, "task_id", int, "an integer")
    code = need(o, "code").replace("\r\n", "\n")  # MBPP's code has Windows line ends; the tests are kept as published
    shadow = _shadowing_function(code, tests)
    if shadow:
        truth["entry_point"] = shadow  # mbpp/126 names its function `sum`: say the tests mean the program's
    prompt = f"{text.strip()}\nYour code should pass these tests:\n{tests[0]}"
    return prompt_row(row, split, "mbpp", str(task_id), prompt, "code", json.dumps(truth, ensure_ascii=False),
                      fence(code), "google-research/mbpp")


def _json_field(o: dict[str, Any], key: str, kind: type, what: str) -> Any:
    value = o.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as e:
            raise RowError(key, f"is not JSON ({e.msg})", f"give {key!r} as published: a JSON string of {what}") from None
    if value is not None and not isinstance(value, kind):
        raise RowError(key, f"is a {type(value).__name__}, not {what}", f"give {key!r} as published")
    return value


def convert_apps(row: Row, split: str) -> dict[str, Any]:
    """APPS {problem_id, question, solutions, input_output, difficulty, url, starter_code}: solutions and
    input_output are JSON strings; input_output ({inputs, outputs, optional fn_name}) is kept as published."""
    o = row.obj
    question = need(o, "question")
    io = _json_field(o, "input_output", dict, "an object {inputs, outputs}")
    if not io or not isinstance(io.get("inputs"), list) or not isinstance(io.get("outputs"), list):
        raise RowError("input_output", "has no inputs/outputs lists", "APPS rows without tests cannot be rewarded: remove the row")
    solutions = _json_field(o, "solutions", list, "a list of programs") or []
    starter = o.get("starter_code") or ""
    if io.get("fn_name"):
        ask = f"Write the Python 3 function `{io['fn_name']}`, starting from this code:\n{fence(starter)}" if starter.strip() \
            else f"Write the Python 3 function `{io['fn_name']}`."
    else:
        ask = STDIO_INSTRUCTION
    pid = need(o, "problem_id", (int, str), "an id")
    return prompt_row(row, split, "apps", f"{split}-{pid}", f"{question.rstrip()}\n\n{ask}", "code",
                      json.dumps({"input_output": io}, ensure_ascii=False),
                      fence(solutions[0]) if solutions and isinstance(solutions[0], str) else None, "codeparrot/apps")


GENERATED_TESTS_CAP = 50  # CodeContests has up to hundreds of generated tests per problem; 50 keep verification fast


def _io_pairs(o: dict[str, Any], key: str) -> list[dict[str, str]]:
    tests = o.get(key) or {"input": [], "output": []}
    if not isinstance(tests, dict) or len(tests.get("input") or []) != len(tests.get("output") or []):
        raise RowError(key, "is not {input: [...], output: [...]} of equal lengths", "give the row as published")
    return [{"input": i, "output": out} for i, out in zip(tests.get("input") or [], tests.get("output") or [])]


def convert_codecontests(row: Row, split: str) -> dict[str, Any]:
    """CodeContests {name, description, public/private/generated_tests, solutions {language, solution}, ...}:
    the tests as {"io": [{input, output}]} (public, private, then at most 50 generated); the first
    Python 3 solution (language 3, PYTHON3) fenced."""
    o = row.obj
    name, description = need(o, "name"), need(o, "description")
    io = _io_pairs(o, "public_tests") + _io_pairs(o, "private_tests") + _io_pairs(o, "generated_tests")[:GENERATED_TESTS_CAP]
    if not io:
        raise RowError("public_tests", "no tests at all (public, private or generated)", "a row without tests cannot be rewarded: remove it")
    sols = o.get("solutions") or {}
    python = [s for lang, s in zip(sols.get("language") or [], sols.get("solution") or [])
              if lang == 3 or str(lang).upper() in ("PYTHON3", "3")]
    return prompt_row(row, split, "codecontests", name, f"{description.rstrip()}\n\n{STDIO_INSTRUCTION}", "code",
                      json.dumps({"io": io}, ensure_ascii=False), fence(python[0]) if python else None,
                      "deepmind/code_contests")
