"""The run config's ``alerts:`` section: one rule per failure a run can show in its metrics, each with its
severity and thresholds. The rules themselves are evaluated by :mod:`rlpipe.alerts`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlpipe.yamlio import Strict


Severity = Literal["info", "warning", "critical"]


_SEVERITY = ("info, warning or critical: the shipped Prefect automations cancel a run on a critical alert "
             "(infra/prefect/automations.yaml).")


class _Rule(Strict):
    enabled: bool = Field(True, description="Evaluate this rule each iteration.")
    severity: Severity = Field("warning", description=_SEVERITY)


class RewardFlatRule(_Rule):
    severity: Severity = Field("critical", description=_SEVERITY)
    for_iterations: int = Field(3, ge=1, description="Fires when every scored reward of the batch was 0, or every "
                                "one 1, in this many iterations in a row: no learning signal.")


class KLHighRule(_Rule):
    factor: float = Field(3.0, gt=0, description="Fires when KL to the reference exceeds train.kl_target × factor …")
    max_kl: float = Field(0.5, gt=0, description="… or, with no kl_target, this value.")


class EntropyCollapseRule(_Rule):
    window: int = Field(5, ge=2, description="Over the last this many iterations (first vs last) …")
    drop: float = Field(0.5, gt=0, lt=1, description="… entropy fell by more than this share while the reward rose.")


class NonFiniteLossRule(_Rule):
    severity: Severity = Field("critical", description=_SEVERITY)


class VerifierErrorRule(_Rule):
    max_rate: float = Field(0.1, ge=0, lt=1, description="Fires when more than this share of samples was not scored "
                            "(status other than ok), or a service's error rate is above it.")


class ThroughputDropRule(_Rule):
    factor: float = Field(0.5, gt=0, lt=1, description="Fires when generation or training throughput stays below "
                          "factor × the median of the (up to 200) iterations before …")
    for_iterations: int = Field(3, ge=1, description="… for this many iterations in a row …")
    min_history: int = Field(3, ge=1, description="… once the run has this many earlier iterations for the median.")


class MemoryGrowthRule(_Rule):
    iterations: int = Field(5, ge=2, description="RSS rose at each of this many iterations in a row …")
    mb: float = Field(256.0, gt=0, description="… and by more than this many MiB in all.")


class MismatchRule(_Rule):
    max_share: float = Field(0.1, gt=0, le=1, description="Fires when more than this share of sampled tokens has "
                             "|log π_trainer − log π_sampler| above train.mismatch_threshold (mismatch/share_above). Not "
                             "evaluated with rollout.async_steps above 0: the sampler's policy is then an update behind.")


class RewardHackingRule(_Rule):
    pass  # its window is reward.hacking_window


class KLRiseRule(_Rule):
    window: int = Field(5, ge=2, description="Over the last this many iterations (this one included) …")
    max_rate: float = Field(0.02, gt=0, description="… KL to the reference rose faster than this much per iteration "
                            "(least-squares slope): a drift kl_high would catch only later.")


class GpuMemoryGrowthRule(_Rule):
    iterations: int = Field(5, ge=2, description="The iteration's peak allocated GPU memory (the highest "
                            "resource/gpu_mem_peak_bytes/* of its stages) rose at each of this many iterations …")
    mb: float = Field(512.0, gt=0, description="… and by more than this many MiB in all. Needs CUDA: on a CPU run "
                      "it is not evaluated (rlpipe doctor's alert-inputs line says so).")


class GpuUtilLowRule(_Rule):
    severity: Severity = Field("info", description=_SEVERITY)
    min_util: float = Field(0.25, gt=0, le=1, description="Fires when every GPU's mean utilisation over the iteration "
                            "(resource/gpu<i>_util, NVML's busy share) stayed below this …")
    for_iterations: int = Field(3, ge=1, description="… for this many iterations in a row. Needs CUDA and pynvml "
                                "(nvidia-ml-py): without them it is not evaluated (rlpipe doctor says so).")


class LossDivergenceRule(_Rule):
    factor: float = Field(10.0, gt=1, description="Fires when |loss| or grad_norm stays above factor × the median of "
                          "its magnitude over the (up to 200) iterations before …")
    for_iterations: int = Field(2, ge=1, description="… for this many iterations in a row …")
    min_history: int = Field(5, ge=1, description="… once the run has this many earlier iterations for the median.")


class AlertsConfig(Strict):
    """Alert rules, evaluated after each iteration. A rule that fires logs ``alerts/<rule>`` = 1 to MLflow, an
    ``ALERT`` line, a row of the run's ``alerts.json`` table and a Prefect event ``rlpipe.alert.<rule>`` with
    its severity, which the shipped automations act on (``rlpipe automations install``)."""

    reward_flat: RewardFlatRule = Field(default_factory=RewardFlatRule, description="Rewards all 0 or all 1.")
    kl_high: KLHighRule = Field(default_factory=KLHighRule, description="KL to the reference above its target.")
    entropy_collapse: EntropyCollapseRule = Field(default_factory=EntropyCollapseRule,
                                                  description="Entropy collapsing while the reward rises.")
    nonfinite_loss: NonFiniteLossRule = Field(default_factory=NonFiniteLossRule,
                                              description="A non-finite loss or gradient in the update.")
    verifier_errors: VerifierErrorRule = Field(default_factory=VerifierErrorRule, description="Verifier error rate.")
    throughput_drop: ThroughputDropRule = Field(default_factory=ThroughputDropRule,
                                                description="Throughput against the run's median.")
    memory_growth: MemoryGrowthRule = Field(default_factory=MemoryGrowthRule, description="Steady memory growth.")
    mismatch: MismatchRule = Field(default_factory=MismatchRule, description="Train/inference log-prob mismatch.")
    reward_hacking: RewardHackingRule = Field(default_factory=RewardHackingRule,
                                              description="Reward-model score up while the true score falls (RLHF).")
    kl_rise: KLRiseRule = Field(default_factory=KLRiseRule, description="KL to the reference rising too fast.")
    gpu_memory_growth: GpuMemoryGrowthRule = Field(default_factory=GpuMemoryGrowthRule,
                                                   description="Steady growth of the peak allocated GPU memory.")
    gpu_util_low: GpuUtilLowRule = Field(default_factory=GpuUtilLowRule, description="GPUs mostly idle.")
    loss_divergence: LossDivergenceRule = Field(default_factory=LossDivergenceRule,
                                                description="Loss or gradient norm blowing up against the run's median.")
    events: bool = Field(True, description="Emit each alert as a Prefect event (false: MLflow and the log only).")
    critical_grace_s: float = Field(15.0, ge=0, description="After a critical alert the run waits up to this long "
                                    "for an automation to cancel it before it starts the next iteration.")
