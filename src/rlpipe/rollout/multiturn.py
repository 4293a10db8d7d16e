"""Multi-turn rollout: a batch of episodes stepped together on one engine, observations masked out.

Each turn, every live episode's context (its prompt plus everything so far) goes to the engine in
one ``generate`` call; each completion is the episode's next action. The environment's answer is
appended as *observation tokens*: they are part of the context the policy conditions on, but carry
``loss_mask = 0`` and a log-prob of 0, so no loss ever reaches them. The history is never
re-tokenized — each turn appends token ids to the last — so the ids the trainer scores are exactly
the ids the engine sampled (re-tokenizing a decoded history can merge or split tokens at turn
boundaries, and the sampled log-probs would then belong to other tokens).

Turns use the model's chat template (``chat=True``): an observation becomes a ``tool`` message and
the next assistant turn's opening, as the template renders them (:class:`TurnFormat`). Plain
prompts (``chat=False``) get the observation and a newline.

An episode whose context would outgrow ``max_context`` is cut and flagged truncated (``Episode.cut``).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from rlpipe.envs.base import Environment
from rlpipe.envs.spec import EnvSpec
from rlpipe.envs.episode import Episode
from rlpipe.rollout.base import RolloutEngine, SamplingConfig
from rlpipe.storage.samples import Sample

if TYPE_CHECKING:
    import pyarrow as pa

_MARK = "\u2063ACTION\u2063"  # an action placeholder no template changes


@dataclass
class EpisodeRollout:
    """One episode as the trainer needs it: token ids, sampling log-probs and the loss mask, per
    response token (actions and observations interleaved), plus the episode itself."""

    prompt_ids: list[int]
    episode: Episode
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    stopped: list[bool] = field(default_factory=list)  # per action: ended with the policy's end token (not cut at the token limit)

    def sample(self, group: int) -> Sample:
        """The episode as a training sample: its outcome reward (None unless the episode ended ``ok``,
        so an environment error is left out of the update) and its loss mask."""
        return Sample(self.prompt_ids, self.response_ids, self.logprobs, self.episode.reward, group,
                      self.loss_mask, self.episode.truncated)

    def append(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Policy tokens (with their log-probs) or, with ``logprobs=None``, observation tokens."""
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [1 if logprobs is not None else 0] * len(ids)


_OBS = "\u2063OBSERVATION\u2063"  # an observation placeholder, likewise


@dataclass(frozen=True)
class TurnFormat:
    """How the chat template frames a turn, read once from the template (rendering it per observation
    would redo the same work every step): ``close`` ends an assistant message after its content, and an
    observation sits between ``before`` and ``after`` (which ends with the next assistant opening)."""

    chat: bool
    close: str = ""
    before: str = ""
    after: str = "\n"

    @classmethod
    def of(cls, tokenizer: Any, chat: bool, role: str = "tool") -> "TurnFormat":
        if not chat:
            return cls(chat=False)
        action = [{"role": "assistant", "content": _MARK}]
        alone = tokenizer.apply_chat_template(action, tokenize=False)
        both = tokenizer.apply_chat_template(action + [{"role": role, "content": _OBS}], tokenize=False,
                                             add_generation_prompt=True)
        if not both.startswith(alone) or alone.count(_MARK) != 1 or both.count(_OBS) != 1:
            raise ValueError("the tokenizer's chat template does not render a conversation as its messages in order; "
                             "multi-turn rollout needs one that does (ChatML and most others do)")
        before, after = both[len(alone):].split(_OBS)
        return cls(chat=True, close=alone[alone.index(_MARK) + len(_MARK):], before=before, after=after)

    def observation_text(self, observation: str, stop_text: str | None) -> str:
        """The text after an action the policy ended with ``stop_text`` (its end token; None when cut at the
        token limit): the rest of the assistant turn, the observation message, the next assistant opening."""
        close = self.close[len(stop_text):] if stop_text and self.close.startswith(stop_text) else self.close
        return close + self.before + observation + self.after

    def end_of_turn_id(self, tokenizer: Any) -> int:
        """The token the policy ends an action with: the template's end-of-message token (ChatML's
        ``<|im_end|>``) when it is a special token, else the end-of-sequence token."""
        close = tokenizer(self.close, add_special_tokens=False)["input_ids"] if self.chat else []
        return close[0] if close and close[0] in tokenizer.all_special_ids else tokenizer.eos_token_id


def _prompt_ids(tokenizer: Any, first_observation: str, chat: bool, system: str | None) -> list[int]:
    if chat:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": first_observation}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        text = first_observation + "\n"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_episodes(engine: RolloutEngine, tokenizer: Any, spec: EnvSpec, tasks: list[tuple[dict[str, Any], int]],
                 sampling: SamplingConfig, *, chat: bool = True, max_context: int = 512,
                 system: str | None = None, make_env: Callable[[], Environment] | None = None,
                 step_workers: int = 1) -> list[EpisodeRollout]:
    """Run one episode per ``(task, seed)``, all live episodes stepping together; episodes whose
    environment failed to start come back with status ``error`` and no tokens. ``make_env`` builds each
    episode's environment (default ``spec.make``: in-process); ``step_workers`` > 1 runs a turn's
    environment calls concurrently (for sandboxed or remote environments, whose calls wait on a process
    or the network). Each turn samples with its own seed, derived from ``sampling.seed``."""
    if sampling.n != 1:
        raise ValueError("run_episodes samples one action per episode and turn; repeat a task for a group")
    turns = TurnFormat.of(tokenizer, chat)
    make_env = make_env or spec.make
    with ThreadPoolExecutor(max_workers=step_workers) if step_workers > 1 else nullcontext() as pool:
        each = pool.map if pool is not None else map
        room = max_context - sampling.max_new_tokens
        rollouts = list(each(lambda ts: _start(make_env(), spec, ts, tokenizer, chat, system, room), tasks))
        live = [r for r in rollouts if r.episode.status == "running"]
        turn = 0
        while live:
            turn_sampling = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 7919 * turn)
            outs = engine.generate([r.prompt_ids + r.response_ids for r in live], turn_sampling)
            for r, (comp,) in zip(live, outs):
                r.append(list(comp.token_ids), list(comp.logprobs))
                r.stopped.append(comp.finish_reason == "stop")
            observations = list(each(lambda pair: pair[0].episode.act(pair[1][0].text), zip(live, outs)))
            for r, (comp,), obs in zip(live, outs, observations):
                if obs is not None:
                    _observe(r, obs, comp, tokenizer, turns, sampling.max_new_tokens, max_context)
            live = [r for r in live if r.episode.status == "running"]
            turn += 1
    return rollouts


def _observe(r: EpisodeRollout, obs: str, comp: Any, tokenizer: Any, turns: TurnFormat, max_new: int, max_context: int) -> None:
    """Append the observation's tokens, or cut the episode when the next turn would not fit the context."""
    stop = tokenizer.decode(comp.token_ids[-1:]) if comp.finish_reason == "stop" else None
    ids = tokenizer(turns.observation_text(obs, stop), add_special_tokens=False)["input_ids"]
    used = len(r.prompt_ids) + len(r.response_ids) + len(ids)
    if used + max_new > max_context:  # the next turn would not fit: end on the action
        r.episode.cut(f"context of {used} tokens with the observation leaves no room for "
                      f"{max_new} more within max_context={max_context}")
    else:
        r.append(ids, None)


def _start(env: Environment, spec: EnvSpec, task_seed: tuple[dict[str, Any], int], tokenizer: Any, chat: bool,
           system: str | None, room: int) -> EpisodeRollout:
    task, seed = task_seed
    ep = Episode(env, task, seed, spec.limits)
    first = ep.start()
    prompt = _prompt_ids(tokenizer, first, chat, system) if first is not None else []
    if len(prompt) > room:  # the task's own fault: its first observation does not fit the context
        ep.fail(f"the first observation takes {len(prompt)} tokens, more than the {room} the context leaves; "
                f"raise max_context or shorten the task")
    return EpisodeRollout(prompt, ep)


def episode_table(rollouts: list[EpisodeRollout], prompts: list[dict[str, Any]], n: int, tokenizer: Any, run_id: str,
                  iteration: int, policy_version: str, generate_s: float) -> "pa.Table":
    """Trajectory rows of episodes: rollout ``i`` is sample ``i % n`` of prompt row ``i // n``. An episode
    that ended ``ok`` carries its reward (status ok), one that ended in ``error`` none (status error,
    the reason kept); its steps go to the ``steps`` column, its loss mask beside the tokens."""
    import pyarrow as pa

    from rlpipe.storage.schemas import TRAJECTORY_SCHEMA

    rows, per = [], generate_s / max(len(rollouts), 1)
    for i, r in enumerate(rollouts):
        ep, p = r.episode, prompts[i // n]
        rows.append({
            "run_id": run_id, "iteration": iteration, "prompt_id": p["id"], "sample_index": i % n,
            "policy_version": policy_version, "prompt_token_ids": r.prompt_ids, "response_token_ids": r.response_ids,
            "response_text": tokenizer.decode(r.response_ids), "logprobs": r.logprobs, "loss_mask": r.loss_mask,
            "steps": ep.record(), "reward": ep.reward, "reward_status": "ok" if ep.status == "ok" else "error",
            "reward_reason": ep.reason or None, "verifier": f"env:{getattr(ep.env, 'name', '?')}",
            "verifier_version": str(getattr(ep.env, "version", "")) or None, "isolation": None,
            "truncated": ep.truncated, "generate_s": per, "verify_s": None,
        })
    return pa.Table.from_pylist(rows, schema=TRAJECTORY_SCHEMA)


def encode_episode(tokenizer: Any, episode: Episode, *, chat: bool = True, system: str | None = None,
                   stopped: list[bool] | None = None) -> EpisodeRollout:
    """A finished episode written out as :func:`run_episodes` lays it out — each action followed by
    the end-of-turn token (mask 1), each observation but the last as observation tokens (mask 0) —
    for supervised training on demonstrations. SFT on such traces and RL on sampled episodes then see
    the same token layout. ``stopped[k]`` False writes action k without the end token, as an action cut
    at the token limit was sampled (default: every action ended). Log-probs are 0: nothing was sampled."""
    if episode.first_observation is None or episode.status == "running":
        raise ValueError(f"only a finished episode can be encoded (status {episode.status}: {episode.reason})")
    turns = TurnFormat.of(tokenizer, chat)
    stop = turns.end_of_turn_id(tokenizer)
    stopped = stopped if stopped is not None else [True] * len(episode.steps)
    out = EpisodeRollout(_prompt_ids(tokenizer, episode.first_observation, chat, system), episode)
    for k, step in enumerate(episode.steps):
        action = tokenizer(step.action, add_special_tokens=False)["input_ids"] + ([stop] if stopped[k] else [])
        out.append(action, [0.0] * len(action))
        out.stopped.append(stopped[k])
        if k < len(episode.steps) - 1:
            text = turns.observation_text(step.observation, tokenizer.decode([stop]) if stopped[k] else None)
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"], None)
    return out
