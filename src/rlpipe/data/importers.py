"""Import published datasets, rows exactly as distributed, into rlpipe's prompt or preference tables.

``rlpipe data import FORMAT SRC --out FILE`` reads SRC — a ``.jsonl``, ``.jsonl.gz``, ``.json`` or
``.parquet`` file, a folder (MATH's one-JSON-file-per-problem layout, or a ``datasets`` folder written
by ``save_to_disk``), or a Hugging Face hub name when the ``datasets`` library is installed — and
converts each row by its format (:data:`FORMATS`). What each format keeps:

- ``gsm8k``: the number after ``####`` (commas removed) as ground truth, and the worked solution for
  SFT, ending "The answer is \\boxed{N}.". GSM8K's calculator annotations (``<<48/2=24>>``) are
  removed from it: they are a tool-use trace of the dataset's authors, not text a model should learn.
- ``math``: the MATH rows ({problem, level, type, solution}: the answer is the last ``\\boxed{}`` of the
  solution, read with balanced braces) and MATH-500 / PRM800K rows (their ``answer`` field); the
  worked solution is kept.
- ``humaneval``, ``mbpp``, ``apps``, ``codecontests``: the reference solution fenced for SFT, and the
  tests as published, in ``ground_truth`` as JSON under the published key names (see each converter).
- ``ultrafeedback``, ``hh-rlhf``: preference pairs, read and validated by :mod:`rlpipe.data.preferences`.

Every row gets a stable id (``humaneval/HumanEval-0``, ``gsm8k/train-12``: the row's 0-based index in
its file when the format has no id of its own), a source, and a split: ``--split``, else the one the
file, folder or hub split name says (``test.jsonl``, ``train_prefs``), else MBPP's own split by task id,
else the format's default (``test`` for HumanEval and MATH, ``train`` otherwise). A row that cannot be converted
stops the import with an error naming the file, the row (1-based) and the field, and the fix: rows are
never dropped silently.
"""

from __future__ import annotations

import ast
import builtins
import gzip
import json
import re
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from rlpipe.data.prompts import SPLITS, Finding, dataset_version, gsm8k_answer, validate_prompts
from rlpipe.storage.schemas import PROMPT_SCHEMA

__all__ = ["FORMATS", "DataImportError", "ImportResult", "boxed_answer", "convert_rows", "import_dataset", "read_source"]


class DataImportError(ValueError):
    """SRC cannot be read, or one of its rows cannot be converted (the message names file, row, field and fix)."""


class RowError(ValueError):
    """Raised by a converter: what is wrong with one field of the row it was given."""

    def __init__(self, name: str, problem: str, fix: str):
        super().__init__(f"{name}: {problem} — {fix}")
        self.field, self.problem, self.fix = name, problem, fix


@dataclass(frozen=True)
class Row:
    """One source row: where it came from (file, 1-based row number, 0-based index) and its object."""

    where: str
    number: int
    index: int
    obj: dict[str, Any]
    relpath: str | None = None  # inside a folder source: the file's path relative to it, without suffix


@dataclass(frozen=True)
class Format:
    kind: str  # "prompts" | "preferences"
    default_split: str  # "": none (MBPP splits by task id)
    convert: Callable[[Row, str], dict[str, Any]]


@dataclass
class ImportResult:
    kind: str
    rows: int
    splits: Counter = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)
    version: str = ""


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...] = str, what: str = "text") -> Any:
    value = obj.get(key)
    if value is None or (isinstance(value, str) and not value.strip() and kind is str):
        raise RowError(key, "missing or empty", f"every row of this format needs {key!r} ({what}); is FORMAT right?")
    if not isinstance(value, kind):
        raise RowError(key, f"is a {type(value).__name__}, not {what}", f"give {key!r} as published ({what})")
    return value


def _fence(code: str) -> str:
    return f"```python\n{code.strip(chr(10)).rstrip()}\n```"


def _prompt_row(row: Row, split: str, fmt: str, rid: str, prompt: str, task: str, ground_truth: str | None,
                solution: str | None, source: str) -> dict[str, Any]:
    return {"id": f"{fmt}/{rid}", "prompt": prompt, "chat": False, "task": task, "ground_truth": ground_truth,
            "tests": None, "split": split, "source": source, "solution": solution}


# -- maths ---------------------------------------------------------------------------------------

def _gsm8k(row: Row, split: str) -> dict[str, Any]:
    """GSM8K {question, answer}: the answer is a worked solution whose last line is ``#### 72``."""
    question, answer = _need(row.obj, "question"), _need(row.obj, "answer")
    parsed = gsm8k_answer(answer)
    if parsed is None:
        raise RowError("answer", "has no final '#### <number>' line", "give GSM8K's answer text as published")
    truth, solution = parsed
    return _prompt_row(row, split, "gsm8k", f"{split}-{row.index}", question, "math", truth, solution, "openai/gsm8k")


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced, or None.

    ``\\{`` and ``\\}`` inside are literal braces and do not count; ``\\boxed 5`` (no braces) gives ``5``."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\b", text)]
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text) or text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        depth += (c == "{") - (c == "}")
        if depth == 0:
            return text[i + 1 : j].strip()
        j += 1
    return None


def _math(row: Row, split: str) -> dict[str, Any]:
    """MATH {problem, level, type, solution} and MATH-500 / PRM800K {problem, solution, answer, subject, level, unique_id}."""
    problem, solution = _need(row.obj, "problem"), _need(row.obj, "solution")
    answer = row.obj.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    truth = answer.strip() if isinstance(answer, str) and answer.strip() else boxed_answer(solution)
    if not truth:
        raise RowError("solution", "has no \\boxed{...} answer and the row has no answer field",
                       "give the row as published (MATH's solution ends with \\boxed{answer})")
    uid = row.obj.get("unique_id") or row.relpath or f"{split}-{row.index}"
    return _prompt_row(row, split, "math", str(uid).removesuffix(".json"), problem, "math", truth, solution,
                       "hendrycks/math")


# -- code ----------------------------------------------------------------------------------------

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


def _humaneval(row: Row, split: str) -> dict[str, Any]:
    """HumanEval {task_id, prompt, canonical_solution, test, entry_point}; the test is kept as published."""
    o = row.obj
    task_id, prompt, entry = _need(o, "task_id"), _need(o, "prompt"), _need(o, "entry_point")
    canonical, test = _need(o, "canonical_solution"), _need(o, "test")
    if not re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\s*\(", prompt, re.M):
        raise RowError("entry_point", f"{entry!r} is not defined by the prompt", "give the row as published")
    truth: dict[str, Any] = {"test": test, "entry_point": entry}
    setup = _helpers(prompt, entry)
    if setup:
        truth["test_setup_code"] = setup
    body = prompt + ("" if prompt.endswith("\n") else "\n")
    return _prompt_row(row, split, "humaneval", task_id.replace("/", "-"), HUMANEVAL_INSTRUCTION + _fence(body),
                       "code", json.dumps(truth, ensure_ascii=False), _fence(prompt + canonical), "openai/humaneval")


# MBPP's own split by task id (Austin et al. 2021, §2.1): 1-10 few-shot prompts, 11-510 test, 511-600 validation.
def _mbpp_split(task_id: int) -> str:
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


def _mbpp(row: Row, split: str) -> dict[str, Any]:
    """MBPP {task_id, text, code, test_list, test_setup_code, challenge_test_list} or the sanitized
    {task_id, prompt, code, test_imports, test_list}; the prompt ends with the first test, as MBPP's does."""
    o = row.obj
    text = o.get("text") if o.get("text") is not None else o.get("prompt")
    if not isinstance(text, str) or not text.strip():
        raise RowError("text", "missing or empty", "every MBPP row has 'text' ('prompt' in the sanitized variant): is FORMAT right?")
    tests = _need(o, "test_list", list, "a list of assert statements")
    if not tests or not all(isinstance(t, str) for t in tests):
        raise RowError("test_list", "is empty or not a list of strings", "give MBPP's test_list as published")
    truth: dict[str, Any] = {"tests": tests}
    if isinstance(o.get("test_setup_code"), str) and o["test_setup_code"].strip():
        truth["test_setup_code"] = o["test_setup_code"]
    if o.get("test_imports"):
        truth["test_imports"] = list(o["test_imports"])
    task_id = _need(o, "task_id", int, "an integer")
    code = _need(o, "code").replace("\r\n", "\n")  # MBPP's code has Windows line ends; the tests are kept as published
    shadow = _shadowing_function(code, tests)
    if shadow:
        truth["entry_point"] = shadow  # mbpp/126 names its function `sum`: say the tests mean the program's
    prompt = f"{text.strip()}\nYour code should pass these tests:\n{tests[0]}"
    return _prompt_row(row, split, "mbpp", str(task_id), prompt, "code", json.dumps(truth, ensure_ascii=False),
                       _fence(code), "google-research/mbpp")


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


def _apps(row: Row, split: str) -> dict[str, Any]:
    """APPS {problem_id, question, solutions, input_output, difficulty, url, starter_code}: solutions and
    input_output are JSON strings; input_output ({inputs, outputs, optional fn_name}) is kept as published."""
    o = row.obj
    question = _need(o, "question")
    io = _json_field(o, "input_output", dict, "an object {inputs, outputs}")
    if not io or not isinstance(io.get("inputs"), list) or not isinstance(io.get("outputs"), list):
        raise RowError("input_output", "has no inputs/outputs lists", "APPS rows without tests cannot be rewarded: remove the row")
    solutions = _json_field(o, "solutions", list, "a list of programs") or []
    starter = o.get("starter_code") or ""
    if io.get("fn_name"):
        ask = f"Write the Python 3 function `{io['fn_name']}`, starting from this code:\n{_fence(starter)}" if starter.strip() \
            else f"Write the Python 3 function `{io['fn_name']}`."
    else:
        ask = STDIO_INSTRUCTION
    pid = _need(o, "problem_id", (int, str), "an id")
    return _prompt_row(row, split, "apps", f"{split}-{pid}", f"{question.rstrip()}\n\n{ask}", "code",
                       json.dumps({"input_output": io}, ensure_ascii=False),
                       _fence(solutions[0]) if solutions and isinstance(solutions[0], str) else None, "codeparrot/apps")


GENERATED_TESTS_CAP = 50  # CodeContests has up to hundreds of generated tests per problem; 50 keep verification fast


def _io_pairs(o: dict[str, Any], key: str) -> list[dict[str, str]]:
    tests = o.get(key) or {"input": [], "output": []}
    if not isinstance(tests, dict) or len(tests.get("input") or []) != len(tests.get("output") or []):
        raise RowError(key, "is not {input: [...], output: [...]} of equal lengths", "give the row as published")
    return [{"input": i, "output": out} for i, out in zip(tests.get("input") or [], tests.get("output") or [])]


def _codecontests(row: Row, split: str) -> dict[str, Any]:
    """CodeContests {name, description, public/private/generated_tests, solutions {language, solution}, ...}:
    the tests as {"io": [{input, output}]} (public, private, then at most 50 generated); the first
    Python 3 solution (language 3, PYTHON3) fenced."""
    o = row.obj
    name, description = _need(o, "name"), _need(o, "description")
    io = _io_pairs(o, "public_tests") + _io_pairs(o, "private_tests") + _io_pairs(o, "generated_tests")[:GENERATED_TESTS_CAP]
    if not io:
        raise RowError("public_tests", "no tests at all (public, private or generated)", "a row without tests cannot be rewarded: remove it")
    sols = o.get("solutions") or {}
    python = [s for lang, s in zip(sols.get("language") or [], sols.get("solution") or [])
              if lang == 3 or str(lang).upper() in ("PYTHON3", "3")]
    return _prompt_row(row, split, "codecontests", name, f"{description.rstrip()}\n\n{STDIO_INSTRUCTION}", "code",
                       json.dumps({"io": io}, ensure_ascii=False), _fence(python[0]) if python else None,
                       "deepmind/code_contests")


# -- preferences ---------------------------------------------------------------------------------


def _ultrafeedback(row: Row, split: str) -> dict[str, Any]:
    """UltraFeedback binarized {prompt, prompt_id, chosen, rejected, score_chosen, score_rejected} (message
    lists), or the original {instruction, completions: [{response, overall_score}, ...]}: there the best
    and the worst completion by overall_score make the pair (the binarized release draws the rejected one
    at random; the worst is reproducible)."""
    o = row.obj
    rid = f"ultrafeedback/{o.get('prompt_id') or f'{split}-{row.index}'}"
    if "completions" in o:
        return _ultrafeedback_original(o, rid, split)
    _need(o, "chosen", list, "a list of messages")
    _need(o, "rejected", list, "a list of messages")
    sc, sr = o.get("score_chosen"), o.get("score_rejected")
    margin = None
    if isinstance(sc, (int, float)) and isinstance(sr, (int, float)):
        if sc < sr:
            raise RowError("score_chosen", f"{sc} is below score_rejected {sr}", "swap chosen and rejected, or remove the row")
        margin = float(sc - sr)
    out = {"id": rid, "chosen": o["chosen"], "rejected": o["rejected"], "margin": margin, "split": split,
           "source": "HuggingFaceH4/ultrafeedback_binarized"}
    return out | ({"prompt": o["prompt"]} if isinstance(o.get("prompt"), str) else {})


def _ultrafeedback_original(o: dict[str, Any], rid: str, split: str) -> dict[str, Any]:
    instruction = _need(o, "instruction")
    scored = [(c["overall_score"], c["response"]) for c in o["completions"] or []
              if isinstance(c, dict) and isinstance(c.get("overall_score"), (int, float)) and isinstance(c.get("response"), str)]
    if len(scored) < 2 or max(scored)[0] == min(scored)[0]:
        raise RowError("completions", "fewer than two scored completions, or all scored the same: no preference",
                       "remove the row, or use the binarized release (HuggingFaceH4/ultrafeedback_binarized)")
    best = max(scored, key=lambda s: s[0])
    worst = min(scored, key=lambda s: s[0])
    return {"id": rid, "prompt": instruction, "chosen": best[1], "rejected": worst[1], "margin": float(best[0] - worst[0]),
            "split": split, "source": "openbmb/UltraFeedback"}


def _hh_rlhf(row: Row, split: str) -> dict[str, Any]:
    """Anthropic HH-RLHF {chosen, rejected}: whole "\\n\\nHuman: … \\n\\nAssistant: …" transcripts. The
    preference loader splits them: the shared text up to the last Assistant turn is the prompt, and the
    last turn of each is the response (it reports transcripts that differ before it)."""
    return {"id": f"hh-rlhf/{split}-{row.index}", "chosen": _need(row.obj, "chosen"),
            "rejected": _need(row.obj, "rejected"), "split": split, "source": "Anthropic/hh-rlhf"}


FORMATS: dict[str, Format] = {
    "gsm8k": Format("prompts", "train", _gsm8k),
    "math": Format("prompts", "test", _math),
    "humaneval": Format("prompts", "test", _humaneval),
    "mbpp": Format("prompts", "", _mbpp),
    "apps": Format("prompts", "train", _apps),
    "codecontests": Format("prompts", "train", _codecontests),
    "ultrafeedback": Format("preferences", "train", _ultrafeedback),
    "hh-rlhf": Format("preferences", "train", _hh_rlhf),
}


# -- reading SRC ---------------------------------------------------------------------------------


def split_from_name(name: str) -> str | None:
    """rlpipe's split for a file or hub split name: ``test.jsonl`` → test, ``train_prefs`` → train, ``valid`` → validation."""
    words = set(re.split(r"[^a-z]+", name.lower()))
    if words & {"test", "eval"}:
        return "test"
    if words & {"validation", "valid", "val", "dev"}:
        return "validation"
    return "train" if "train" in words else None


def _file_objects(path: Path) -> list[dict[str, Any]]:
    """The objects of one file: JSON lines (also gzipped), a JSON list or object, or Parquet."""
    name = path.name.lower()
    if name.endswith(".parquet"):
        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # noqa: BLE001
            raise DataImportError(f"{path}: not a readable Parquet file: {e}") from None
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataImportError(f"{path}: cannot read it ({e}); give a .jsonl, .jsonl.gz, .json or .parquet file") from None
    if name.endswith(".json"):
        try:
            data = json.loads(text)
            return data if isinstance(data, list) else [data]
        except json.JSONDecodeError:
            pass  # some .json files are JSON lines
    objects = []
    for n, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataImportError(f"{path} line {n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
    return objects


def _hf_datasets():
    """The Hugging Face ``datasets`` library, or None. A folder named ``datasets`` on sys.path imports as an
    empty namespace package, hence the check for ``load_dataset``."""
    try:
        import datasets
    except ImportError:
        return None
    return datasets if hasattr(datasets, "load_dataset") else None


def _hub_rows(src: str, split: str) -> list[dict[str, Any]]:
    datasets = _hf_datasets()
    if datasets is None:
        raise DataImportError(f"{src}: no such file or folder, and the `datasets` library is not installed to read it "
                              "from the hub; `pip install datasets`, or download the file and give its path")
    path = Path(src)
    try:
        ds = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.load_dataset(src, split=split)
    except Exception as e:  # noqa: BLE001 - hub, network and format errors all end the import the same way
        raise DataImportError(f"{src}: the `datasets` library could not load it ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataImportError(f"{src}: has splits {sorted(ds)}, not {split!r}; choose one with --split")
        ds = ds[split]
    return [dict(r) for r in ds]


def read_source(src: str | Path, split: str | None = None, hub_split: str = "train") -> Iterator[tuple[Row, str | None]]:
    """Each row of SRC with the split its file name implies (None: unknown). SRC is a file, a folder of
    .json/.jsonl files (MATH's layout: each file's path is its row's id), a ``save_to_disk`` folder,
    or a hub name (needs ``datasets``; the hub split read is ``split``, else ``hub_split``)."""
    path = Path(src)
    if path.is_file():
        for i, obj in enumerate(_file_objects(path)):
            yield Row(str(path), i + 1, i, obj), split_from_name(path.name)
    elif path.is_dir() and not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
        files = sorted(p for p in path.rglob("*") if p.is_file() and re.search(r"\.(jsonl?|jsonl\.gz|parquet)$", p.name))
        if not files:
            raise DataImportError(f"{path}: no .json, .jsonl or .parquet files in this folder")
        index, base = 0, path.parent if split_from_name(path.name) else path  # MATH/test/algebra/1.json → test/algebra/1
        for file in files:
            rel = file.relative_to(base).as_posix()
            for n, obj in enumerate(_file_objects(file), start=1):
                yield Row(str(file), n, index, obj, rel.rsplit(".", 1)[0] if file.suffix == ".json" else None), \
                    split_from_name(rel)
                index += 1
    else:
        for i, obj in enumerate(_hub_rows(str(src), split or hub_split)):
            yield Row(str(src), i + 1, i, obj), split_from_name(split or hub_split)


# -- converting and writing ----------------------------------------------------------------------


def _row_split(fmt: Format, name: str, row: Row, given: str | None, implied: str | None) -> str:
    if given:
        split = split_from_name(given) or given
    elif implied:
        split = implied
    elif name == "mbpp" and isinstance(row.obj.get("task_id"), int):
        split = _mbpp_split(row.obj["task_id"])
    else:
        split = fmt.default_split or "train"
    if split not in SPLITS:
        raise DataImportError(f"--split {given!r}: not one of {', '.join(SPLITS)} (or a name such as train_prefs, test, valid)")
    return split


def convert_rows(name: str, src: str | Path, split: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """SRC's rows converted by format ``name``; the first row that cannot be converted raises
    :class:`DataImportError` naming the file, the row, the field and the fix."""
    if name not in FORMATS:
        raise DataImportError(f"unknown format {name!r}; use one of: {', '.join(FORMATS)}")
    fmt, out = FORMATS[name], []
    for row, implied in read_source(src, split, fmt.default_split or "train"):
        if limit is not None and len(out) >= limit:
            break
        if not isinstance(row.obj, dict):
            raise DataImportError(f"{row.where} row {row.number}: is a {type(row.obj).__name__}, not an object — give one JSON object per row")
        try:
            converted = fmt.convert(row, _row_split(fmt, name, row, split, implied))
        except RowError as e:
            raise DataImportError(f"{row.where} row {row.number}: {e}") from None
        if isinstance(src, str) and not Path(src).exists():
            converted["source"] = src  # a hub name says exactly where the rows came from
        out.append(converted)
    return out


def _write_jsonl(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def _write(table: pa.Table, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        pq.write_table(table, out)
    else:
        _write_jsonl(table.to_pylist(), out)


def import_dataset(name: str, src: str | Path, out: str | Path, split: str | None = None,
                   limit: int | None = None) -> ImportResult:
    """Convert SRC by format ``name``, write OUT (.jsonl or .parquet), and validate what was written:
    prompt tables with :func:`~rlpipe.data.prompts.validate_prompts`, preference pairs with
    :func:`~rlpipe.data.preferences.load_preferences` (which also normalises them to its schema)."""
    out = Path(out)
    if out.suffix not in (".jsonl", ".parquet"):
        raise DataImportError(f"--out {out}: use a .jsonl or .parquet file name")
    rows = convert_rows(name, src, split, limit)
    if not rows:
        raise DataImportError(f"{src}: no rows to import")
    if FORMATS[name].kind == "preferences":
        from rlpipe.data.preferences import load_preferences, preference_version

        with tempfile.TemporaryDirectory() as tmp:  # the preference loader reads files: its rules, not a copy of them
            _write_jsonl(rows, Path(tmp) / "pairs.jsonl")
            table, findings = load_preferences(Path(tmp) / "pairs.jsonl")
        version = preference_version(table)
    else:
        table = pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)
        findings, version = validate_prompts(table), dataset_version(table)
    _write(table, out)
    return ImportResult(FORMATS[name].kind, table.num_rows, Counter(table.column("split").to_pylist()), findings, version)
