"""The evaluation suite: benchmarks described by YAML files (``configs/evals/<name>.yaml``), each a prompt
table, a split, a verifier and sampling settings, run on one engine and judged by the verifier pool.

A benchmark file names its prompt file; the repository ships small samples (``datasets/evals/*.sample.jsonl``)
and ``rlpipe data import …`` writes the full benchmarks in the same prompt format. Overrides
``BENCH.key=value`` (``rlpipe evaluate --suite-set``, the flow's ``overrides``) point a benchmark at another
file or change its settings for one evaluation, validated like the file.

Paths: a relative ``prompts`` in a benchmark file is relative to that file (as ``extends:`` in run configs);
one given as an override is relative to the current directory, as paths on a command line are.

No Prefect, MLflow or engine import here: the caller hands in the engine, the tokenizer and the verifier pool
(``tasks/evaluate.py``), and the numbers come from :func:`rlpipe.evaluation.benchmark_metrics`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from pydantic import Field, model_validator

from rlpipe.config import ConfigError, apply_overrides, read_yaml, validate_model
from rlpipe.yamlio import Strict
from rlpipe.evaluation import Judged, benchmark_metrics

__all__ = ["Benchmark", "PreparedBenchmark", "SamplingSpec", "EVALS_DIR", "benchmark_rows", "cut_at_stop", "load_benchmark",
           "load_suite", "prepare_benchmark", "render_prompt_text", "run_benchmark", "suite_context"]

EVALS_DIR = Path("configs") / "evals"  # benchmark names are looked up here, under the current directory first
_CHECKOUT = Path(__file__).resolve().parents[2]  # then under the checkout this package runs from
TABLE_ROWS = 2000  # responses per benchmark kept in MLflow's table view (the metrics count every one)


class SamplingSpec(Strict):
    """Sampled responses for pass@k."""

    n: int = Field(10, ge=1, description="Samples per problem.")
    temperature: float = Field(0.8, gt=0, description="Sampling temperature (> 0; the greedy answer is `greedy`).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling mass.")
    k: list[int] = Field([1, 5, 10], min_length=1, description="pass@k reported for each k (each 1 <= k <= n).")

    @model_validator(mode="after")
    def _k_within_n(self) -> "SamplingSpec":
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"@k@k={bad} with n={self.n} samples: pass@k needs 1 <= k <= n; raise sampling.n or drop those k")
        return self


class Benchmark(Strict):
    """One benchmark of the suite (a ``configs/evals/<name>.yaml`` file)."""

    name: str = Field(description="Name in metric keys (`<name>/greedy_acc`); default: the file's stem.")
    description: str = Field("", description="What the benchmark measures and where its full file comes from.")
    prompts: str = Field(description="Prompt table (JSONL/Parquet, rlpipe's prompt format); relative: to this file.")
    split: Optional[str] = Field("test", description="Rows of this split only; null: every row.")
    task: Optional[str] = Field(None, description="Verifier for every row (overrides each row's `task`); null: the rows' own.")
    limit: Optional[int] = Field(None, ge=1, description="The first N rows only (a quick look); null: all.")
    max_new_tokens: int = Field(512, ge=1, description="Longest response in tokens; a response that hits it counts as truncated.")
    greedy: bool = Field(True, description="One greedy response per problem (greedy_acc).")
    sampling: Optional[SamplingSpec] = Field(None, description="n sampled responses per problem (pass@k); null: none.")
    seed: int = Field(0, description="Seed of the sampled responses (each prompt's samples seeded apart).")
    template: str = Field("{prompt}", description="The text the model gets; `{prompt}` stands for the row's prompt "
                          "(replaced as text, so LaTeX braces elsewhere need no escaping).")
    system_prompt: Optional[str] = Field(None, description="A system message (chat); a preamble before the text otherwise.")
    chat: Optional[bool] = Field(None, description="Render through the model's chat template; null: when the tokenizer has one.")
    stop: list[str] = Field([], description="Cut each response at the first of these strings before judging (a base "
                            "model that runs on into the next question); mean_len still counts the tokens generated.")

    @model_validator(mode="after")
    def _measures_something(self) -> "Benchmark":
        if not self.greedy and self.sampling is None:
            raise ValueError("@greedy@greedy is false and there is no sampling section: nothing to measure")
        if "{prompt}" not in self.template:
            raise ValueError("@template@the template has no {prompt}: every problem would get the same text")
        return self


def _benchmark_file(spec: str) -> Path:
    """``gsm8k`` → configs/evals/gsm8k.yaml (here, else in the checkout); a path to a YAML file as it is."""
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        return Path(spec)
    for root in (Path.cwd(), _CHECKOUT):
        if (root / EVALS_DIR / f"{spec}.yaml").exists():
            return root / EVALS_DIR / f"{spec}.yaml"
    known = sorted(p.stem for p in (_CHECKOUT / EVALS_DIR).glob("*.yaml"))
    raise ConfigError(spec, [("", f"no benchmark {spec!r} in {EVALS_DIR}/ (known: {', '.join(known) or 'none'}); "
                              "give a name from that folder or a path to a benchmark YAML file")])


def load_benchmark(spec: str, overrides: list[str] | None = None) -> Benchmark:
    """A benchmark by name or path, with ``key=value`` overrides (dotted inside the file: ``sampling.n=4``)."""
    path = _benchmark_file(spec)
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(str(path), [("", "the top level must be a mapping")])
    raw.setdefault("name", path.stem)
    if isinstance(raw.get("prompts"), str) and not Path(raw["prompts"]).is_absolute():
        raw["prompts"] = str(path.parent / raw["prompts"])
    return validate_model(Benchmark, apply_overrides(raw, overrides, source=f"--suite-set {path.stem}"), str(path))


def load_suite(specs: list[str] | str, overrides: list[str] | None = None) -> list[Benchmark]:
    """The suite's benchmarks (``"gsm8k,mbpp"`` or a list), each with its ``NAME.key=value`` overrides.

    An override for a benchmark not in the suite is an error (a typo would otherwise change nothing)."""
    names = [s.strip() for s in (specs.split(",") if isinstance(specs, str) else specs) if s.strip()]
    if not names:
        raise ConfigError("--suite", [("", "no benchmark named; e.g. --suite gsm8k,math500,humaneval,mbpp")])
    per: dict[str, list[str]] = {}
    for item in overrides or []:
        bench, dot, rest = item.partition(".")
        if not dot or "=" not in rest:
            raise ConfigError("--suite-set", [(item, "an override is 'BENCH.key=value', e.g. gsm8k.prompts=datasets/evals/gsm8k.jsonl")])
        per.setdefault(bench, []).append(rest)
    benches = [load_benchmark(s, per.get(_stem(s))) for s in names]
    unknown = sorted(set(per) - {_stem(s) for s in names})
    if unknown:
        raise ConfigError("--suite-set", [(u, f"{u!r} is not in the suite ({', '.join(b.name for b in benches)})") for u in unknown])
    dup = sorted({b.name for b in benches if [c.name for c in benches].count(b.name) > 1})
    if dup:
        raise ConfigError("--suite", [("", f"benchmark name(s) {dup} twice: metric keys would collide; give each its own name")])
    return benches


def _stem(spec: str) -> str:
    return Path(spec).stem if spec.endswith((".yaml", ".yml")) else spec


# -- rows and prompts --------------------------------------------------------------------------------------


@dataclass
class PreparedBenchmark:
    """A benchmark's rows, the token ids of their rendered prompts, and the prompt file's content version."""

    bench: Benchmark
    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    dataset_version: str


def benchmark_rows(bench: Benchmark, options: dict[str, dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], str]:
    """The rows the benchmark scores (split, task override, limit), validated, and the chosen rows' version.

    A problem in a row (no reference, a reference its verifier cannot use, a duplicate) is an error naming the
    row: scoring around it would change the benchmark's denominator unseen."""
    import pyarrow as pa

    from rlpipe.data.prompts import PromptFileError, dataset_version, load_prompts, validate_prompts
    from rlpipe.storage.schemas import PROMPT_SCHEMA

    try:
        rows = load_prompts(bench.prompts).to_pylist()
    except PromptFileError as e:
        raise ValueError(f"benchmark {bench.name}: {e}; import the benchmark (rlpipe data import …) or set "
                         f"--suite-set {bench.name}.prompts=FILE") from None
    chosen = [r for r in rows if bench.split is None or r["split"] == bench.split]
    if not chosen:
        have = sorted({r["split"] for r in rows})
        raise ValueError(f"benchmark {bench.name}: {bench.prompts} has no {bench.split!r} rows (its splits: {have}); "
                         f"set --suite-set {bench.name}.split=<one of them> (or null for all)")
    chosen = [r | {"task": bench.task} if bench.task else r for r in chosen][: bench.limit]
    table = pa.Table.from_pylist(chosen, schema=PROMPT_SCHEMA)
    findings = validate_prompts(table, options=options)
    if findings:
        shown = "; ".join(map(str, findings[:5])) + (f"; and {len(findings) - 5} more" if len(findings) > 5 else "")
        raise ValueError(f"benchmark {bench.name}: {bench.prompts}: {shown} (rlpipe data validate {bench.prompts} lists all)")
    return chosen, dataset_version(table)


def render_prompt_text(bench: Benchmark, row: dict[str, Any], chat_template: bool) -> tuple[str, bool]:
    """``(prompt, chat)`` as :func:`rlpipe.tokens.encode_prompt` takes them: the template around the row's prompt
    (a chat row: around its last user message), as chat messages or plain text."""
    if row["chat"]:
        msgs = json.loads(row["prompt"])
        last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        msgs[last] = msgs[last] | {"content": bench.template.replace("{prompt}", msgs[last]["content"])}
        if bench.system_prompt and msgs[0]["role"] != "system":
            msgs = [{"role": "system", "content": bench.system_prompt}] + msgs
        return json.dumps(msgs), True
    text = bench.template.replace("{prompt}", row["prompt"])
    if not (bench.chat if bench.chat is not None else chat_template):
        return (f"{bench.system_prompt}\n\n{text}" if bench.system_prompt else text), False
    system = [{"role": "system", "content": bench.system_prompt}] if bench.system_prompt else []
    return json.dumps(system + [{"role": "user", "content": text}]), True


def prepare_benchmark(bench: Benchmark, tokenizer: Any, options: dict[str, dict[str, Any]] | None = None) -> PreparedBenchmark:
    """Rows and token ids, before any engine starts (a bad file or template fails in seconds)."""
    from rlpipe.tokens import encode_prompt

    rows, version = benchmark_rows(bench, options)
    has_template = bool(getattr(tokenizer, "chat_template", None))
    ids = [encode_prompt(tokenizer, *render_prompt_text(bench, r, has_template)) for r in rows]
    return PreparedBenchmark(bench, rows, ids, version)


def suite_context(prepared: list[PreparedBenchmark], own: int | None) -> int:
    """The engine's context: the longest prompt plus its benchmark's max_new_tokens. Over the model's own
    context (``own``) is an error naming the benchmark: positions it never saw would make the numbers noise."""
    need = {p.bench.name: max(len(i) for i in p.prompt_ids) + p.bench.max_new_tokens for p in prepared}
    over = {name: n for name, n in need.items() if own is not None and n > own}
    if over:
        raise ValueError(f"the model's context is {own} tokens (max_position_embeddings) but " + ", ".join(
            f"{name} needs {n} (its longest prompt + max_new_tokens)" for name, n in over.items())
            + "; lower max_new_tokens (--suite-set NAME.max_new_tokens=…) or evaluate a model with a longer context")
    return max(need.values())


# -- generation and judging --------------------------------------------------------------------------------


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` (the stop string itself left out), and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def run_benchmark(engine: Any, pool: Any, prepared: PreparedBenchmark) -> dict[str, Any]:
    """Generate (greedy and/or sampled), judge every response, and compute the metrics.

    Returns ``metrics`` (:func:`rlpipe.evaluation.benchmark_metrics`), ``problems`` (per row: its id, the greedy
    verdict ``[status, reward]`` or None, and each sample's verdict) and ``table`` (responses for MLflow)."""
    from rlpipe.rewards.pool import VerifyItem
    from rlpipe.rollout.base import SamplingConfig

    b, rows = prepared.bench, prepared.rows
    runs: list[tuple[str, list[list[Any]]]] = []
    if b.greedy:
        runs.append(("greedy", engine.generate(prepared.prompt_ids, SamplingConfig(n=1, temperature=0.0, max_new_tokens=b.max_new_tokens))))
    if b.sampling is not None:
        s = b.sampling
        runs.append(("sample", engine.generate(prepared.prompt_ids, SamplingConfig(
            n=s.n, temperature=s.temperature, top_p=s.top_p, max_new_tokens=b.max_new_tokens, seed=b.seed))))
    flat = [(kind, i, j, c) for kind, outs in runs for i, per in enumerate(outs) for j, c in enumerate(per)]
    texts = [cut_at_stop(c.text, b.stop) for _, _, _, c in flat]
    refs = [r["ground_truth"] if r["ground_truth"] is not None else r["tests"] for r in rows]
    verdicts = pool.score([VerifyItem(rows[i]["task"], t, refs[i]) for (_, i, _, _), (t, _) in zip(flat, texts)])
    judged = {kind: [[] for _ in rows] for kind, _ in runs}
    table = []
    for (kind, i, j, c), (t, stopped), v in zip(flat, texts, verdicts):
        jd = Judged(v.status, v.reward, len(c.token_ids), c.finish_reason == "length" and not stopped)
        judged[kind][i].append(jd)
        if len(table) < TABLE_ROWS:
            table.append({"id": rows[i]["id"], "kind": kind if kind == "greedy" else f"sample {j}", "response": t,
                          "status": v.status, "reward": v.reward, "reason": v.reason, "correct": jd.correct,
                          "n_tokens": jd.n_tokens, "truncated": jd.truncated})
    greedy = [per[0] for per in judged["greedy"]] if "greedy" in judged else None
    samples = judged.get("sample")
    metrics = benchmark_metrics(greedy, samples, b.sampling.k if b.sampling else [])
    problems = [{"id": r["id"], "greedy": [greedy[i].status, greedy[i].reward] if greedy else None,
                 "samples": [[jd.status, jd.reward] for jd in samples[i]] if samples else []} for i, r in enumerate(rows)]
    return {"name": b.name, "metrics": metrics, "problems": problems, "table": table}
