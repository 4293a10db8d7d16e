import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "dist_update.py"


VARIANTS = {
    # critic (own engine and optimizer), GAE, KL folded into the reward, entropy bonus, 2 epochs, seq-mean-token-sum
    "ppo": ["algorithm=ppo", "kl_in=reward", "entropy_coef=0.01", "ppo_epochs=2", "loss_agg_mode=seq_mean_token_sum",
            "critic_lr=1e-3"],
    # constant normaliser, overlong filtering (truncated rows masked), dual clip, k2 KL in the loss
    "dr_grpo": ["algorithm=dr_grpo", "mask_truncated=true", "dual_clip=3.0", "kl_estimator=k2"],
    # sequence-level ratio, seq-mean-token-mean, clip-higher
    "gspo": ["algorithm=gspo", "clip_ratio_low=0.0003", "clip_ratio_high=0.0004"],
}
# Every case, updated from the same checkpoint by one rank and by two: one launch per world size.
CASES = {f"zero{z}": {"zero": z, "kl": 0.05} for z in (0, 1, 2, 3)} | {
    "zero2_offload": {"zero": 2, "kl": 0.05, "sets": ["offload_optimizer=true"]},
    # micro-batches by token budget (a varying number of them per mini-batch and rank), padded and packed, ZeRO 0 and 2
    "tokens_padded": {"zero": 0, "kl": 0.05, "sets": ["max_tokens_per_micro_batch=30", "pack_sequences=false"]},
    "tokens_packed_zero2": {"zero": 2, "kl": 0.05, "sets": ["max_tokens_per_micro_batch=30"]},
    # bfloat16 weights, float32 masters split over the ranks (DeepSpeed's bf16 optimizer at 1, ZeRO's at 2)
    "bf16_weights_zero1": {"zero": 1, "kl": 0.05, "sets": ["precision=bf16_weights"]},
    "bf16_weights_zero2": {"zero": 2, "kl": 0.05, "sets": ["precision=bf16_weights"]},
    # … by a token budget: a rank with fewer micro-batches than the other runs empty ones (an idle backward)
    "bf16_weights_tokens": {"zero": 1, "kl": 0.05, "sets": ["precision=bf16_weights", "max_tokens_per_micro_batch=30"]}} | {
    name: {"zero": 0, "kl": 0.05, "sets": sets} for name, sets in VARIANTS.items()}


def _launch(model, out, nproc):
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "OMP_NUM_THREADS": "1"}  # this checkout
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    from tests.helpers.s3server import free_port

    out.mkdir(parents=True)
    (out / "cases.json").write_text(json.dumps(CASES))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
           str(SCRIPT), "--model", str(model), "--out", str(out), "--cases", str(out / "cases.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: (json.loads((out / name / "metrics.json").read_text()), load_file(out / name / "model.safetensors"))
            for name in CASES}


@pytest.fixture(scope="module")
def updates(tiny_checkpoint, tmp_path_factory):
    """{world size: {case: (metrics, weights)}}."""
    root = tmp_path_factory.mktemp("dist-updates")
    return {n: _launch(tiny_checkpoint, root / f"world{n}", n) for n in (1, 2)}


@pytest.mark.parametrize("zero", [0, 1, 2, 3, "2_offload"])
def test_two_ranks_give_the_same_update_as_one(tiny_checkpoint, updates, zero):
    (m1, w1), (m2, w2) = updates[1][f"zero{zero}"], updates[2][f"zero{zero}"]
    assert m1["world"] == 1 and m2["world"] == 2
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    moved = max(float((w1[k] - before[k]).abs().max()) for k in w1)
    assert moved > 1e-4  # the update did something
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-6, rtol=1e-5), k
    for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac", "tokens"):
        assert abs(m1["metrics"][key] - m2["metrics"][key]) < 1e-5 * max(1.0, abs(m1["metrics"][key])), key
    assert m1["metrics"]["samples_excluded"] == 4 and m1["metrics"]["optimizer_steps"] == 3


@pytest.mark.parametrize("case", ["tokens_padded", "tokens_packed_zero2"])
def test_token_budget_micro_batches_give_the_count_update_on_one_and_two_ranks(updates, case):
    """Micro-batches cut by a 30-token budget (their number varies by mini-batch and rank) make the same
    optimizer steps as GAS count micro-batches: the loss is normalised by the mini-batch's totals."""
    count = updates[1]["zero0"]
    for world in (1, 2):
        metrics, weights = updates[world][case]
        for k in weights:
            # 1% of one lr-1e-3 Adam step: other sums of the same terms, and Adam magnifies tiny gradients' rounding
            assert torch.allclose(weights[k], count[1][k], atol=1e-5), (world, k)
        for key in ("loss", "pg_loss", "kl", "tokens"):
            assert metrics["metrics"][key] == pytest.approx(count[0]["metrics"][key], rel=1e-5, abs=1e-7), key
        assert metrics["metrics"]["micro_batches"] != count[0]["metrics"]["micro_batches"]
        assert metrics["metrics"]["micro/over_budget"] == 0


def test_zero3_on_two_ranks_exports_the_folder_zero0_writes(updates):
    """Each of two ranks holds half of every weight under ZeRO-3; the export gathers them into the same
    whole folder as one rank without ZeRO (same names, dtypes and values up to float rounding)."""
    w0, w3 = updates[1]["zero0"][1], updates[2]["zero3"][1]
    assert sorted(w0) == sorted(w3)
    for k in w0:
        assert w0[k].dtype == w3[k].dtype and w0[k].shape == w3[k].shape, k
        assert torch.allclose(w0[k], w3[k], atol=2e-6, rtol=1e-5), k


@pytest.mark.parametrize("case,float32", [("bf16_weights_zero1", "zero1"), ("bf16_weights_zero2", "zero2")])
def test_bf16_weights_on_two_ranks_give_the_same_update_as_one(tiny_checkpoint, updates, case, float32):
    """bf16_weights exports the bfloat16 weights; two ranks (masters and moments split, float32 gradients reduced)
    land on one rank's update up to a bfloat16 rounding of the same float32 masters, and near the float32 run's."""
    (m1, w1), (m2, w2) = updates[1][case], updates[2][case]
    f32 = updates[1][float32][1]
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    for k in w1:
        assert w1[k].dtype == w2[k].dtype == torch.bfloat16, k
        ulp = w1[k].float().abs() * 2**-7 + 1e-30
        assert bool(((w1[k].float() - w2[k].float()).abs() <= ulp).all()), k  # at most one bfloat16 step apart
        assert (w1[k].float() != w2[k].float()).float().mean() < 0.01, k
    # The float32 run's update, in direction (Adam's steps magnify the bfloat16 forward's gradient rounding)
    moved = torch.cat([(w1[k].float() - before[k]).reshape(-1) for k in w1])
    moved32 = torch.cat([(f32[k] - before[k]).reshape(-1) for k in w1])
    cos = float(torch.nn.functional.cosine_similarity(moved, moved32, dim=0))
    assert cos > 0.9 and float(moved.abs().max()) > 1e-3, cos
    for key in ("loss", "pg_loss", "kl", "tokens"):
        assert m1["metrics"][key] == pytest.approx(m2["metrics"][key], rel=1e-2, abs=1e-4), key
    assert m1["metrics"]["optimizer_steps"] == m2["metrics"]["optimizer_steps"] == 3


def test_bf16_weights_by_token_budget_on_two_ranks_is_one_ranks_update(tiny_checkpoint, updates):
    """By a token budget the ranks' micro-batches hold other samples than one rank's, so their bfloat16 forwards
    round differently and Adam's first steps turn a tiny gradient's rounding into a whole step: the same loss and
    gradient norm to 1e-3, the same update in direction, most weights equal."""
    (m1, w1), (m2, w2) = updates[1]["bf16_weights_tokens"], updates[2]["bf16_weights_tokens"]
    before = load_file(Path(tiny_checkpoint) / "model.safetensors")
    for key in ("loss", "grad_norm"):
        assert m1["metrics"][key] == pytest.approx(m2["metrics"][key], rel=1e-3), key
    one = torch.cat([(w1[k].float() - before[k]).reshape(-1) for k in w1])
    two = torch.cat([(w2[k].float() - before[k]).reshape(-1) for k in w1])
    assert float(torch.nn.functional.cosine_similarity(one, two, dim=0)) > 0.95
    assert float((one == two).float().mean()) > 0.7


def test_cases_in_one_process_equal_a_fresh_process(tiny_checkpoint, updates, tmp_path):
    """Sharing a launch between cases changes nothing: the last case alone in a new process gives the same weights."""
    last = list(CASES)[-1]
    script = (f"import os, sys; sys.path[:0] = [{str(ROOT / 'src')!r}, {str(ROOT)!r}]\n"
              "from pathlib import Path; from tests.helpers.dist_update import run_case\n"
              f"run_case({str(tiny_checkpoint)!r}, Path({str(tmp_path)!r}), 0, 0.05, {CASES[last].get('sets', [])!r})\n")
    env = dict(os.environ) | {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    from tests.helpers.s3server import free_port

    proc = subprocess.run([sys.executable, "-c", script], env=env | {"MASTER_PORT": str(free_port())}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = load_file(tmp_path / "model.safetensors")
    shared = updates[1][last][1]
    assert all(torch.equal(alone[k], shared[k]) for k in shared)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_two_ranks_equal_one_for_every_loss_shape(updates, variant):
    """The global counts behind each aggregation mode (and the critic's step) do not depend on the split."""
    (m1, w1), (m2, w2) = updates[1][variant], updates[2][variant]
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=2e-6, rtol=1e-5), k
    keys = ["loss", "pg_loss", "kl", "kl_loss", "entropy", "clip_frac", "tokens"]
    if variant == "ppo":
        keys += ["vf_loss", "value_mse", "explained_variance"]
        assert m1["metrics"]["optimizer_steps"] == 6  # 2 epochs × 3 mini-batches
    for key in keys:
        assert abs(m1["metrics"][key] - m2["metrics"][key]) < 1e-5 * max(1.0, abs(m1["metrics"][key])), key
    if variant == "dr_grpo":  # the truncated (5-token) responses are out of the loss
        from tests.helpers.dist_update import fixed_batch

        kept = sum(len(s.response_ids) for s in fixed_batch() if s.valid and not s.truncated)
        assert m1["metrics"]["tokens"] == kept


def _ppo_trainer(model_dir, resume_dir=None):
    from rlpipe.config import TrainConfig
    from rlpipe.training.trainer import PolicyTrainer

    cfg = TrainConfig(algorithm="ppo", batch_size=16, micro_batch_size=8, lr=1e-3, kl_coef=0.05, kl_target=0.01,
                      kl_horizon=100, kl_in="reward", critic={"lr": 1e-3})
    return PolicyTrainer(model_dir=str(model_dir), cfg=cfg, seed=3, resume_dir=resume_dir and str(resume_dir), max_new_tokens=5)


def test_ppo_resume_restores_policy_critic_and_kl_controller(tiny_checkpoint, tmp_path):
    """Save after iteration 0, resume in a fresh trainer: iteration 1 lands on identical weights,
    critic values and adaptive KL coefficient as the uninterrupted trainer."""
    import random

    from tests.helpers.dist_update import fixed_batch

    torch.set_num_threads(1)
    batch0, batch1 = fixed_batch(32), fixed_batch(48)[16:]
    random.Random(5).shuffle(batch1)
    a = _ppo_trainer(tiny_checkpoint)
    m0 = a.update(batch0, 0)
    assert m0["kl"] > 0.01 and m0["kl_coef"] == 0.05  # β used in iteration 0 is the start value …
    assert a.kl_ctl.value > 0.05  # … and the measured KL above target raises it for the next one
    a.save(tmp_path / "state")
    saved_beta = a.kl_ctl.value
    m1 = a.update(batch1, 1)
    b = _ppo_trainer(tiny_checkpoint, resume_dir=tmp_path / "state")
    assert b.kl_ctl.value == saved_beta == m1["kl_coef"]
    m1b = b.update(batch1, 1)
    for key in ("loss", "vf_loss", "kl_coef", "explained_variance", "grad_norm", "critic_grad_norm"):
        assert m1[key] == pytest.approx(m1b[key], rel=1e-6, abs=1e-9), key
    for (name, pa_), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa_, pb), name
    for (name, pa_), (_, pb) in zip(a.critic.module.named_parameters(), b.critic.module.named_parameters()):
        assert torch.equal(pa_, pb), name
    assert m1["vf_loss"] > 0 and m1["kl_coef"] > m0["kl_coef"]


def _grpo_trainer(model_dir, resume_dir=None):
    from rlpipe.config import TrainConfig
    from rlpipe.training.trainer import PolicyTrainer

    cfg = TrainConfig(algorithm="grpo", batch_size=16, micro_batch_size=8, lr=1e-3)
    return PolicyTrainer(model_dir=str(model_dir), cfg=cfg, seed=3, resume_dir=resume_dir and str(resume_dir), max_new_tokens=5)


@pytest.mark.parametrize("layout", ["module_left_out", "module_inside"])
def test_the_deepspeed_state_holds_the_optimizer_not_the_weights_again(tiny_checkpoint, tmp_path, layout):
    """A save point writes the weights once (the HF safetensors the trainer is rebuilt from) and the optimizer in
    DeepSpeed's checkpoint; resuming lands on the uninterrupted trainer's weights, Adam moments included. A state
    saved before the module was left out (its weights inside DeepSpeed's file) still resumes the same."""
    from tests.helpers.dist_update import fixed_batch

    torch.set_num_threads(1)
    batch0, batch1 = fixed_batch(16), fixed_batch(32)[16:]
    a = _grpo_trainer(tiny_checkpoint)
    a.update(batch0, 0)
    if layout == "module_left_out":
        a.save(tmp_path / "state")
    else:  # the layout of earlier versions
        a.export_weights(tmp_path / "state")
        a.engine.save_checkpoint(str(tmp_path / "state" / "deepspeed"), tag="state", save_latest=False)
        (tmp_path / "state" / "trainer_state.json").write_text(json.dumps(dict(a.state) | {"world_size": 1}))
    ds = torch.load(tmp_path / "state" / "deepspeed" / "state" / "mp_rank_00_model_states.pt", weights_only=False)
    moments = [t for s in ds["optimizer"]["state"].values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert sum(t.numel() for t in moments) == 2 * sum(p.numel() for p in a.module.parameters())  # exp_avg, exp_avg_sq
    assert (len(ds["module"]) == 0) == (layout == "module_left_out")
    assert "module_state_dict" not in vars(a.engine)  # the engine's own method is back after the save
    m1 = a.update(batch1, 1)
    b = _grpo_trainer(tiny_checkpoint, resume_dir=tmp_path / "state")
    m1b = b.update(batch1, 1)
    assert m1["loss"] == pytest.approx(m1b["loss"], rel=1e-6, abs=1e-9) and m1["grad_norm"] == m1b["grad_norm"]
    for (name, pa_), (_, pb) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(pa_, pb), name
