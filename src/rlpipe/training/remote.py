"""The trainer service (``rlpipe serve trainer``) driven like an in-process :class:`PolicyTrainer`.

Nothing moves but through the object store and HTTP: the start policy (and reference / critic models)
are uploaded once under ``runs/<run>/trainer/<what>/<sha256[:16]>/``; a resume names the run's checkpoint
prefix in the store; each update names the scored stages and gets back the sha256 of the new weights, which
the sync streams from the service in buckets, and, at a save point, the checkpoint prefix the service wrote the
resumable state to, marked whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlpipe import http_client
from rlpipe.config import TrainConfig

__all__ = ["RemoteTrainer", "TrainerDown", "upload_model"]


class TrainerDown(ConnectionError):
    """The trainer service did not answer, or answered with a server error."""


def upload_model(store: Any, run_id: str, what: str, folder: str | Path) -> dict[str, str]:
    """A model folder in the store under the run's prefix (once per content): {"uri", "sha256"}."""
    from rlpipe.storage.weights import file_weights_digest

    sha = file_weights_digest(folder)
    key = f"runs/{run_id}/trainer/{what}/{sha[:16]}"
    if not store.exists(f"{key}/_uploaded.json"):
        store.upload_dir(folder, key)
        store.put_json(f"{key}/_uploaded.json", {"weights_sha256": sha})
    return {"uri": store.url(key), "sha256": sha}


class RemoteTrainer:
    """One trainer service at ``url`` holding this run's policy; ``rank``/``world`` as the service reports."""

    remote = True

    def __init__(self, url: str, store: Any, run_id: str, model_dir: str, cfg: TrainConfig, temperature: float = 1.0,
                 seed: int = 0, ref_model_dir: str | None = None, resume_dir: str | None = None,
                 max_new_tokens: int | None = None, timeout_s: float = 3600.0):
        from rlpipe.tokens import load_tokenizer

        self.url, self.store, self.run_id, self.cfg, self.timeout_s = url.rstrip("/"), store, run_id, cfg, timeout_s
        self.name = f"trainer@{self.url}"
        self.tokenizer = load_tokenizer(resume_dir or model_dir)
        train = cfg.model_dump(mode="json")
        critic = upload_model(store, run_id, "critic", cfg.critic.model) if cfg.critic.model else None
        body = {"run_id": run_id, "policy": upload_model(store, run_id, "policy", model_dir),
                "resume": self._resume(resume_dir) if resume_dir else None,
                "ref": upload_model(store, run_id, "ref", ref_model_dir) if ref_model_dir and cfg.uses_reference else None,
                "critic": critic, "train": train, "seed": seed, "temperature": temperature, "max_new_tokens": max_new_tokens}
        got = self._post("/init", body)
        self.version, self.world, self.rank = got["version"], int(got["world"]), 0
        # the last update's weights (bf16_weights: the rounded start weights): bucket count, and once streamed
        self._buckets, self._handoff = int(got.get("buckets", 0)), None

    def _resume(self, resume_dir: str) -> dict[str, str]:
        """The run's checkpoint in the store that ``resume_dir`` is a copy of (uploaded first if it is not there whole)."""
        from rlpipe.resume import RunState
        from rlpipe.storage.weights import file_weights_digest
        from rlpipe.training.checkpoint import read_trainer_state

        state = read_trainer_state(resume_dir)
        k, sha = int(state["iteration"]), file_weights_digest(resume_dir)
        run = RunState(self.store, Path(resume_dir), self.run_id)
        if not run.state_complete(k, sha):
            if not (Path(resume_dir) / "deepspeed").is_dir():
                raise FileNotFoundError(f"the state of iteration {k} ({sha[:12]}) is neither whole in "
                                        f"{self.store.url(run.checkpoint_prefix(k))} nor complete in {resume_dir}")
            run.upload_state(Path(resume_dir), k, sha)
        return {"uri": self.store.url(run.checkpoint_prefix(k)), "sha256": sha}

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            r = http_client.post("trainer", f"{self.url}{path}", json=body, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise TrainerDown(f"trainer service {self.url}{path}: {type(e).__name__}: {e}; restart it and resume the run "
                              "with the same --run-id (its state is in the object store)") from None
        if r.status_code >= 500 or r.status_code == 429:
            raise TrainerDown(f"trainer service {self.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        if r.status_code != 200:
            raise ValueError(f"trainer service {self.url}{path} refused the request: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def update_stages(self, stages: list[str], iteration: int, dynamic_batch: int | None, step_rewards: bool,
                      extra_state: dict[str, Any], save: bool = True) -> dict[str, Any]:
        """One update on the scored stages; the service keeps the new weights to stream (:meth:`policy_tensors`),
        and with ``save`` (a save point) writes the resumable state to the store (``saved``)."""
        out = self._post("/update", {"run_id": self.run_id, "iteration": iteration, "stages": stages, "save": save,
                                     "dynamic_batch": dynamic_batch, "step_rewards": step_rewards, "extra_state": extra_state})
        if out.get("weights_sha256"):
            self.version, self._buckets, self._handoff = out["weights_sha256"], int(out["buckets"]), None
        return out

    def policy_tensors(self) -> tuple[str, dict[str, Any]]:
        """The weights of the last update, streamed from the service in buckets (no store between) and checked
        against the hash it took: (sha256, name → tensor), fetched once per update."""
        import httpx

        from rlpipe.storage.weight_stream import decode_buckets
        from rlpipe.guards import WeightSyncError
        from rlpipe.storage.weights import weights_digest

        if self._handoff is None:
            parts = []
            for k in range(self._buckets):
                try:
                    r = http_client.get("trainer", f"{self.url}/weights/{self.version}/{k}", timeout=self.timeout_s)
                except httpx.HTTPError as e:
                    raise TrainerDown(f"trainer service {self.url}: streaming weights: {type(e).__name__}: {e}") from None
                if r.status_code != 200:
                    raise WeightSyncError(f"trainer service {self.url}: bucket {k} of weights {self.version[:12]}: "
                                          f"HTTP {r.status_code}: {r.text[:300]}")
                parts.append(r.content)
            tensors = decode_buckets(parts)
            if (got := weights_digest(tensors)) != self.version:
                raise WeightSyncError(f"the weights streamed from {self.url} hash to {got[:12]}, the service reported "
                                      f"{self.version[:12]}: the transfer was not whole")
            self._handoff = (self.version, tensors)
        return self._handoff

    def handoff(self) -> tuple[Any, dict[str, Any]]:
        """:meth:`policy_tensors` as :meth:`PolicyTrainer.handoff` gives them: the hash (the service's, checked
        here) in a future that is already done."""
        from rlpipe.threads import done

        digest, tensors = self.policy_tensors()
        return done(digest), tensors

    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        return self._post("/logprobs", {"run_id": self.run_id, "prompts": prompts, "continuations": continuations})["logprobs"]

    def fetch_weights(self, prefix: str, sha256: str, dest: Path) -> Path:
        """The top-level files of a checkpoint (weights, config, tokenizer, trainer state) into ``dest``, checked."""
        import shutil

        from rlpipe.storage.weights import file_weights_digest

        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for key in self.store.list(prefix):
            rel = key[len(prefix.strip("/")) + 1:]
            if "/" not in rel and not rel.startswith("_"):
                (dest / rel).write_bytes(self.store.get_bytes(key))
        if (got := file_weights_digest(dest)) != sha256:
            raise ValueError(f"{self.store.url(prefix)} holds weights {got[:12]}, the trainer service reported {sha256[:12]}")
        return dest
