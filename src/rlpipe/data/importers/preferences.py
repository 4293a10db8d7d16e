"""Importers of preference datasets: UltraFeedback and Anthropic HH-RLHF, read as pairs (validated
afterwards by :mod:`rlpipe.data.preferences`)."""

from __future__ import annotations

from typing import Any

from rlpipe.data.importers.rows import Row, RowError, need


def convert_ultrafeedback(row: Row, split: str) -> dict[str, Any]:
    """UltraFeedback binarized {prompt, prompt_id, chosen, rejected, score_chosen, score_rejected} (message
    lists), or the original {instruction, completions: [{response, overall_score}, ...]}: there the best
    and the worst completion by overall_score make the pair (the binarized release draws the rejected one
    at random; the worst is reproducible)."""
    o = row.obj
    rid = f"ultrafeedback/{o.get('prompt_id') or f'{split}-{row.index}'}"
    if "completions" in o:
        return _ultrafeedback_original(o, rid, split)
    need(o, "chosen", list, "a list of messages")
    need(o, "rejected", list, "a list of messages")
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
    instruction = need(o, "instruction")
    scored = [(c["overall_score"], c["response"]) for c in o["completions"] or []
              if isinstance(c, dict) and isinstance(c.get("overall_score"), (int, float)) and isinstance(c.get("response"), str)]
    if len(scored) < 2 or max(scored)[0] == min(scored)[0]:
        raise RowError("completions", "fewer than two scored completions, or all scored the same: no preference",
                       "remove the row, or use the binarized release (HuggingFaceH4/ultrafeedback_binarized)")
    best = max(scored, key=lambda s: s[0])
    worst = min(scored, key=lambda s: s[0])
    return {"id": rid, "prompt": instruction, "chosen": best[1], "rejected": worst[1], "margin": float(best[0] - worst[0]),
            "split": split, "source": "openbmb/UltraFeedback"}


def convert_hh_rlhf(row: Row, split: str) -> dict[str, Any]:
    """Anthropic HH-RLHF {chosen, rejected}: whole "\\n\\nHuman: … \\n\\nAssistant: …" transcripts. The
    preference loader splits them: the shared text up to the last Assistant turn is the prompt, and the
    last turn of each is the response (it reports transcripts that differ before it)."""
    return {"id": f"hh-rlhf/{split}-{row.index}", "chosen": need(row.obj, "chosen"),
            "rejected": need(row.obj, "rejected"), "split": split, "source": "Anthropic/hh-rlhf"}
