"""Alert rules on a run's per-iteration metrics (config section ``alerts``).

Each rule reads the iteration's metrics and the run's history (earlier iterations' metrics, oldest
first) and returns a message when it fires. :func:`evaluate` runs every enabled rule and returns
the fired :class:`Alert` s with their severity, plus ``alerts/<rule>`` (1.0 fired, 0.0 not) for
every rule that had the metrics it reads. What is done with an alert — MLflow, the log, a Prefect
event an automation acts on — is the caller's: this module imports no orchestrator.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any, Callable, Sequence

from rlpipe.config import RunConfig

__all__ = ["Alert", "RULES", "evaluate", "guard_alert"]

Metrics = dict[str, float]
History = Sequence[dict[str, Any]]
_GPU_UTIL = re.compile(r"resource/gpu\d+_util")


@dataclass(frozen=True)
class Alert:
    rule: str
    severity: str
    message: str
    value: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Skip(Exception):
    """The rule's inputs are not in this run's metrics (e.g. no KL term, no held-out evaluation yet)."""


def _get(m: Metrics, key: str) -> float:
    if key not in m or m[key] is None:
        raise _Skip(key)
    return float(m[key])


def _flat(m: dict[str, Any]) -> float | None:
    """0 or 1 when every scored reward of the batch was that value, else None."""
    if m.get("status_ok", 0.0) <= 0 or m.get("reward_std", 1.0) != 0.0 or m.get("reward_mean") not in (0.0, 1.0):
        return None
    return float(m["reward_mean"])


def _reward_flat(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    n, run = cfg.alerts.reward_flat.for_iterations, 0
    value = _flat(m)
    for h in [m, *reversed(hist)]:
        if _flat(h) is None or _flat(h) != value:
            break
        run += 1
    if value is None or run < n:
        return None, float(run)
    return (f"every scored reward was {value:g} in the last {run} iteration(s) (≥ {n}): no learning signal; "
            "check the verifier, the prompts' difficulty and max_new_tokens"), float(run)


def _kl_high(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    kl, rule, target = _get(m, "kl"), cfg.alerts.kl_high, cfg.train.kl_target
    limit, what = (target * rule.factor, f"kl_target {target:g} × {rule.factor:g}") if target else (rule.max_kl, "max_kl")
    if kl <= limit:
        return None, kl
    return f"KL to the reference {kl:.4g} is above {what} = {limit:.4g}: lower the lr or raise kl_coef", kl


def _entropy_collapse(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    rule = cfg.alerts.entropy_collapse
    points = [h for h in hist if "entropy" in h and "reward_mean" in h][-(rule.window - 1):] + [m]
    e1, r1 = _get(m, "entropy"), _get(m, "reward_mean")
    if len(points) < rule.window:
        return None, 0.0
    e0, r0 = float(points[0]["entropy"]), float(points[0]["reward_mean"])
    drop = 1 - e1 / e0 if e0 > 0 else 0.0
    if drop <= rule.drop or r1 <= r0:
        return None, drop
    return (f"entropy fell {e0:.3f} → {e1:.3f} ({drop:.0%}) over {rule.window} iterations while the reward rose "
            f"{r0:.3f} → {r1:.3f}: the policy is collapsing onto what pays; check for reward hacking, raise the "
            "temperature or train.clip_ratio_high"), drop


def _nonfinite_loss(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    skipped = _get(m, "nonfinite_steps")
    loss = m.get("loss", 0.0)
    if skipped <= 0 and math.isfinite(loss):
        return None, skipped
    return (f"{skipped:.0f} optimizer step(s) had a non-finite loss or gradient (loss {loss:.4g}); they were skipped: "
            "lower the lr, check mismatch/abs_max"), skipped


def _verifier_errors(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    limit = cfg.alerts.verifier_errors.max_rate
    rates = {"samples not scored (1 − status_ok)": 1.0 - _get(m, "status_ok")}
    rates |= {f"service {k.split('/')[1]} error rate": v for k, v in m.items()
              if k.startswith("service/") and k.endswith("/error_rate")}
    worst = max(rates, key=rates.get)
    if rates[worst] <= limit:
        return None, rates[worst]
    return f"{worst} is {rates[worst]:.1%}, above {limit:.0%}: see status_* and verifier/* metrics", rates[worst]


def _throughput_drop(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    """A sustained drop: each of the last ``for_iterations`` iterations below ``factor`` × the median of the
    iterations before them in ``hist`` (the run gives its last 200; a one-iteration dip on a busy machine is not one)."""
    rule, worst = cfg.alerts.throughput_drop, None
    for key in ("throughput/generate_tokens_per_s", "throughput/train_tokens_per_s"):
        series = [float(h[key]) for h in hist if h.get(key, 0.0) > 0] + ([float(m[key])] if key in m else [])
        before, window = series[:-rule.for_iterations], series[-rule.for_iterations:]
        if key not in m or len(before) < rule.min_history or len(window) < rule.for_iterations:
            continue
        med = median(before)
        ratio = max(window) / med  # the best of the window: every one is below factor × median when this is
        if worst is None or ratio < worst[1]:
            worst = (key, ratio, med)
    if worst is None:
        raise _Skip("throughput history")
    key, ratio, med = worst
    if ratio >= rule.factor:
        return None, ratio
    return (f"{key} stayed below {rule.factor:.0%} of the run's median {med:.4g} for {rule.for_iterations} iterations "
            f"(now {m[key]:.4g}): another job on the machine, a slow service, or swapping?"), ratio


def _memory_growth(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    from rlpipe.tracking.resources import memory_growth

    rss = [h["resource/rss_bytes"] for h in hist if "resource/rss_bytes" in h] + [_get(m, "resource/rss_bytes")]
    rule = cfg.alerts.memory_growth
    return memory_growth(rss, rule.iterations, rule.mb * 2**20), rss[-1]


def _mismatch(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    if cfg.rollout.async_steps:  # the sampler's policy is an update behind: the gap is that update, not the engine
        raise _Skip("rollout.async_steps")  # (the doctor's alert-inputs line says so)
    share, limit = _get(m, "mismatch/share_above"), cfg.alerts.mismatch.max_share
    if share <= limit:
        return None, share
    return (f"{share:.1%} of sampled tokens differ between trainer and sampler by more than "
            f"{cfg.train.mismatch_threshold:g} in log-prob (above {limit:.0%}): the engine's numerics or a stale "
            "weight sync; consider train.tis_cap"), share


def _reward_hacking(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    from rlpipe.rewards.model import reward_hacking

    now = (_get(m, "heldout_rm_score"), _get(m, "heldout_true_score"))
    past = [(h["heldout_rm_score"], h["heldout_true_score"]) for h in hist
            if "heldout_rm_score" in h and "heldout_true_score" in h] + [now]
    msg = reward_hacking([p[0] for p in past], [p[1] for p in past], cfg.reward.hacking_window)
    return msg, now[0] - now[1]


def _slope(ys: Sequence[float]) -> float:
    """The least-squares slope of ``ys`` against 0, 1, 2, …: change per iteration, robust to one noisy point."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    return sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sum((x - xm) ** 2 for x in range(n))


def _kl_rise(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    """KL still below kl_high's limit but climbing fast: the drift shows here iterations before it crosses it."""
    rule, kl = cfg.alerts.kl_rise, _get(m, "kl")
    series = [float(h["kl"]) for h in hist if h.get("kl") is not None][-(rule.window - 1):] + [kl]
    if len(series) < rule.window:
        return None, 0.0
    rate = _slope(series)
    if rate <= rule.max_rate:
        return None, rate
    return (f"KL to the reference rose {rate:.4g} per iteration over the last {rule.window} iterations "
            f"({series[0]:.4g} → {kl:.4g}), faster than max_rate {rule.max_rate:g}: the policy is drifting from the "
            "reference; lower the lr, raise kl_coef or set train.kl_target, and check for reward hacking"), rate


def _gpu_peak(m: dict[str, Any]) -> float | None:
    """The iteration's peak allocated GPU memory: the highest of its stages' (CUDA runs only)."""
    peaks = [float(v) for k, v in m.items() if k.startswith("resource/gpu_mem_peak_bytes/")]
    return max(peaks) if peaks else None


def _gpu_memory_growth(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    """On torch's peak *allocated* memory, not NVML's used memory: the caching allocator keeps what it reserved,
    so the used memory plateaus while a leak grows inside it, until the out-of-memory error."""
    from rlpipe.tracking.resources import memory_growth

    now = _gpu_peak(m)
    if now is None:
        raise _Skip("resource/gpu_mem_peak_bytes/*")
    series = [p for h in hist if (p := _gpu_peak(h)) is not None] + [now]
    rule = cfg.alerts.gpu_memory_growth
    return memory_growth(series, rule.iterations, rule.mb * 2**20, what="peak allocated GPU memory",
                         see="resource/gpu_mem_peak_bytes/*"), now


def _gpu_utils(m: dict[str, Any]) -> list[float]:
    return [float(v) for k, v in m.items() if _GPU_UTIL.fullmatch(k)]


def _gpu_util_low(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    rule, now = cfg.alerts.gpu_util_low, _gpu_utils(m)
    if not now:
        raise _Skip("resource/gpu<i>_util")
    streak = 0
    for row in [m, *reversed(hist)]:
        utils = _gpu_utils(row)
        if not utils or max(utils) >= rule.min_util:
            break
        streak += 1
    if streak < rule.for_iterations:
        return None, max(now)
    return (f"every GPU was busy less than {rule.min_util:.0%} of the iteration for {streak} iteration(s) in a row "
            f"(busiest now {max(now):.0%}): the GPUs wait on something else; see time/* for the stage that takes "
            "the time (generation on the CPU, the verifier, the object store) or raise the batch size"), max(now)


def _loss_divergence(cfg: RunConfig, m: Metrics, hist: History) -> tuple[str | None, float]:
    """|loss| or grad_norm above ``factor`` × its median magnitude, for ``for_iterations`` in a row. Magnitudes:
    the policy-gradient loss changes sign. A non-finite value is nonfinite_loss's, not this rule's."""
    rule, worst = cfg.alerts.loss_divergence, None
    for key in ("loss", "grad_norm"):
        if key not in m or not math.isfinite(m[key]):
            continue
        series = [abs(float(h[key])) for h in hist if h.get(key) is not None and math.isfinite(h[key])]
        series.append(abs(float(m[key])))
        before, window = series[:-rule.for_iterations], series[-rule.for_iterations:]
        if len(before) < rule.min_history or len(window) < rule.for_iterations:
            continue
        med = median(before)
        ratio = min(window) / med if med > 0 else (math.inf if min(window) > 0 else 0.0)
        if worst is None or ratio > worst[1]:
            worst = (key, ratio, med)
    if worst is None:
        raise _Skip("loss history")
    key, ratio, med = worst
    if ratio <= rule.factor:
        return None, ratio
    return (f"|{key}| stayed above {rule.factor:g} × the run's median {med:.4g} for {rule.for_iterations} "
            f"iteration(s) (now {abs(m[key]):.4g}): the update is diverging; lower the lr or train.grad_clip, and "
            "check mismatch/* and ratio/max"), ratio


RULES: dict[str, Callable[[RunConfig, Metrics, History], tuple[str | None, float]]] = {
    "reward_flat": _reward_flat, "kl_high": _kl_high, "entropy_collapse": _entropy_collapse,
    "nonfinite_loss": _nonfinite_loss, "verifier_errors": _verifier_errors, "throughput_drop": _throughput_drop,
    "memory_growth": _memory_growth, "mismatch": _mismatch, "reward_hacking": _reward_hacking,
    "kl_rise": _kl_rise, "gpu_memory_growth": _gpu_memory_growth, "gpu_util_low": _gpu_util_low,
    "loss_divergence": _loss_divergence,
}


def evaluate(config: RunConfig, metrics: Metrics, history: History) -> tuple[list[Alert], Metrics]:
    """The alerts that fire on this iteration's ``metrics`` given the earlier iterations' ``history``, and
    ``alerts/<rule>`` for every enabled rule whose inputs the run has."""
    fired, flags = [], {}
    for name, rule in RULES.items():
        settings = getattr(config.alerts, name)
        if not settings.enabled:
            continue
        try:
            message, value = rule(config, metrics, history)
        except _Skip:
            continue
        flags[f"alerts/{name}"] = float(message is not None)
        if message is not None:
            fired.append(Alert(name, settings.severity, message, float(value)))
    return fired, flags


def guard_alert(config: RunConfig, rule: str, message: str) -> Alert | None:
    """The alert for a guard that stopped the run (non-finite updates, the reward circuit breaker), at its
    rule's severity; None when that rule is disabled."""
    settings = getattr(config.alerts, rule)
    return Alert(rule, settings.severity, message, 1.0) if settings.enabled else None
