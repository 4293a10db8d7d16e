"""``rlpipe serve reward-model | verifier | rollout | trainer | env``: rlpipe's HTTP services, each refusing to
listen beyond loopback without its credential."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from rlpipe.cli.common import refused
from rlpipe.config import settings

serve_app = typer.Typer(help="Run rlpipe's services.", no_args_is_help=True)

# Options several services share; each command gives its own default.
Host = Annotated[str, typer.Option(help="Address to listen on (loopback by default).")]
Port = Annotated[int, typer.Option(help="TCP port.")]
Queue = Annotated[int, typer.Option(help="Requests that may wait; more are refused with 429.")]


@serve_app.command("reward-model")
def serve_reward_model(
    model_uri: Annotated[str, typer.Argument(help="The reward model: a folder or models:/NAME@ALIAS (e.g. models:/rlpipe-arithmetic-rlhf-rm@best).")],
    host: Host = "127.0.0.1",
    port: Port = 8766,
    max_queue: Queue = 64,
    max_batch_items: Annotated[int, typer.Option(help="Most items scored in one forward batch (concurrent requests are micro-batched).")] = 512,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits before its items get status timeout.")] = 30.0,
) -> None:
    """HTTP reward-model service: /health, batch /score, /metrics. Point runs at it with services.reward_model (or RLPIPE_REWARD_MODEL_URL)."""
    from rlpipe.services.reward_model import serve
    from rlpipe.training.models import load_reward_model

    _listen_ok("reward_model", host)
    with refused("serve reward-model", (LookupError, FileNotFoundError)):
        scorer = load_reward_model(model_uri, settings())
    typer.echo(f"reward-model service {scorer.version} on http://{host}:{port} (queue {max_queue}, batch ≤ {max_batch_items})", err=True)
    serve(scorer, host=host, port=port, max_queue=max_queue, max_batch_items=max_batch_items, request_timeout_s=request_timeout)


@serve_app.command("verifier")
def serve_verifier(
    host: Host = "127.0.0.1",
    port: Port = 8765,
    workers: Annotated[int, typer.Option(help="Verifier worker processes (bounded concurrency).")] = 2,
    grace: Annotated[float, typer.Option(help="Seconds past each verifier's declared budget before a sample is killed (status timeout).")] = 5.0,
    request_timeout: Annotated[float, typer.Option(help="Least time a request without timeout_s is given; more when its batch's declared budgets need it.")] = 60.0,
    max_queue: Queue = 32,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra verifiers (repeatable).")] = None,
    timeout: Annotated[Optional[float], typer.Option(hidden=True)] = None,
) -> None:
    """HTTP verifier service: /health, batch /verify, /metrics. Point runs at it with services.verifier (or RLPIPE_VERIFIER_URL)."""
    if timeout is not None:
        typer.echo("serve verifier: --timeout was removed: each sample's deadline is its verifier's declared "
                   "budget plus --grace; use --grace SECONDS", err=True)
        raise typer.Exit(2)
    from rlpipe.services.verifier import serve

    _listen_ok("verifier", host)
    typer.echo(f"verifier service on http://{host}:{port} ({workers} workers, grace {grace:g} s, queue {max_queue})", err=True)
    serve(host=host, port=port, workers=workers, grace_s=grace, max_queue=max_queue,
          request_timeout_s=request_timeout, plugins=tuple(plugin or ()))


@serve_app.command("rollout")
def serve_rollout(
    model_uri: Annotated[str, typer.Argument(help="The policy to start from: a folder or models:/NAME@ALIAS.")],
    engine: Annotated[str, typer.Option(help="Engine: vllm or hf.")] = "vllm",
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default; elsewhere needs RLPIPE_ROLLOUT_TOKEN).")] = "127.0.0.1",
    port: Port = 8768,
    max_model_len: Annotated[int, typer.Option(help="Positions per sequence (prompt + completion).")] = 256,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for the engine; more are refused with 429.")] = 8,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits for its turn (then 504).")] = 300.0,
    seed: Annotated[int, typer.Option(help="Engine seed (requests carry their own sampling seeds).")] = 0,
    gpu_memory_utilization: Annotated[float, typer.Option(help="vLLM: the GPU's share the engine may take (0.9 when the service has its GPU alone).")] = 0.3,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vLLM: most sequences in one step (default: vLLM's).")] = None,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM: GPUs the engine spans.")] = 1,
    enable_prefix_caching: Annotated[bool, typer.Option(help="vLLM: reuse the KV cache of shared prefixes.")] = False,
    lora_rank: Annotated[int, typer.Option(help="vLLM: serve LoRA adapters up to this rank (≥ the runs' train.lora.r), "
                                           "so that runs with rollout.lora_sync: adapter send only the adapter (POST "
                                           "/adapter); 0: no LoRA support.")] = 0,
) -> None:
    """HTTP rollout service: /generate, /logprobs, /weights (from the object store) and /weights/stream (streamed in
    buckets), both hash-checked, /adapter (a LoRA adapter alone, with --lora-rank), /health, /metrics. Runs point at
    its replicas with services.rollout (or RLPIPE_ROLLOUT_URL, comma-separated)."""
    from rlpipe.rollout.engines import new_engine
    from rlpipe.services.rollout import serve
    from rlpipe.storage import open_store
    from rlpipe.training.models import fetch_source, resolve_source

    _listen_ok("rollout", host)
    if lora_rank and engine != "vllm" or lora_rank < 0:
        typer.echo(f"serve rollout: --lora-rank {lora_rank}: LoRA adapters are served by the vllm engine only, at a "
                   "rank ≥ 1 (0: none)", err=True)
        raise typer.Exit(2)
    s = settings()
    with refused("serve rollout", (LookupError, FileNotFoundError)):
        folder = fetch_source(resolve_source(model_uri, s), s)
    if lora_rank:
        from rlpipe.rollout.vllm_engine import _lora_options

        with refused("serve rollout --lora-rank", (ValueError,)):  # above vLLM's largest LoRA slot: before it starts
            _lora_options(lora_rank)
    eng = new_engine(engine, folder, max_model_len=max_model_len, seed=seed, **(
        {"gpu_memory_utilization": gpu_memory_utilization, "max_num_seqs": max_num_seqs,
         "tensor_parallel_size": tensor_parallel_size, "enable_prefix_caching": enable_prefix_caching,
         "lora_rank": lora_rank or None} if engine == "vllm" else {}))
    lora = f", LoRA up to rank {lora_rank}" if lora_rank else ""
    typer.echo(f"rollout service ({eng.name}, weights {eng.weights_sha256()[:12]}{lora}) on http://{host}:{port}", err=True)
    serve(eng, folder, open_store(s.resolve_storage_uri(), s), host=host, port=port, max_model_len=max_model_len,
          max_queue=max_queue, request_timeout_s=request_timeout)


@serve_app.command("trainer")
def serve_trainer(
    nproc: Annotated[int, typer.Option(help="Ranks (processes) of the DeepSpeed group on this machine.")] = 1,
    host: Annotated[str, typer.Option(help="Address to listen on (loopback by default; elsewhere needs RLPIPE_TRAINER_TOKEN).")] = "127.0.0.1",
    port: Port = 8769,
    max_queue: Annotated[int, typer.Option(help="Requests that may wait for the ranks; more are refused with 429.")] = 4,
    request_timeout: Annotated[float, typer.Option(help="Seconds a request without timeout_s waits for its result (then 504).")] = 3600.0,
) -> None:
    """HTTP trainer service: the policy trainer as NPROC ranks under torchrun; rank 0 answers /init, /update
    (trajectories from the object store in; the new resumable state written there; sha256 and metrics out),
    /logprobs, /health, /metrics. Runs point at it with services.trainer (or RLPIPE_TRAINER_URL)."""
    from rlpipe.services.trainer import launch_cmd

    _listen_ok("trainer", host)
    if nproc < 1:
        typer.echo("serve trainer: --nproc must be at least 1", err=True)
        raise typer.Exit(2)
    cmd = launch_cmd(nproc, host, port, max_queue, request_timeout)
    typer.echo(f"trainer service ({nproc} rank(s)) on http://{host}:{port}", err=True)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)  # torchrun in this process: a signal to this PID reaches every rank


def _listen_ok(name: str, host: str) -> None:
    """Exit 2 before anything starts when a service would listen beyond loopback without a credential."""
    from rlpipe.services._common import check_listen
    from rlpipe.http_client import service_token

    with refused(f"serve {name.replace('_', '-')}", (ValueError, OSError)):
        check_listen(name, host, service_token(name))


@serve_app.command("env")
def serve_env(
    host: Host = "127.0.0.1",
    port: Port = 8767,
    workers: Annotated[int, typer.Option(help="Sandboxes running at once (bounded concurrency).")] = 2,
    max_queue: Queue = 64,
    step_timeout: Annotated[float, typer.Option(help="Seconds one environment step may take; past it the episode is an error.")] = 10.0,
    cpu: Annotated[float, typer.Option(help="CPU seconds per sandboxed call.")] = 10.0,
    memory_mb: Annotated[int, typer.Option(help="Memory per sandboxed call (MB).")] = 512,
    plugin: Annotated[Optional[list[str]], typer.Option(help="Module registering extra environments (repeatable).")] = None,
    allow_host: Annotated[Optional[list[str]], typer.Option(help="host:port environments may reach through rlpipe.envs.net.connect (repeatable); default: no network.")] = None,
) -> None:
    """HTTP environment service: /health, /reset, /step, /metrics; every call in its own sandbox.
    Point runs at it with services.env (or RLPIPE_ENV_URL)."""
    import importlib

    from rlpipe.envs.sandboxed import SandboxOptions
    from rlpipe.services.env import serve

    _listen_ok("env", host)
    for mod in plugin or ():
        importlib.import_module(mod)
    opts = SandboxOptions(step_timeout_s=step_timeout, cpu_s=cpu, memory_mb=memory_mb, plugins=tuple(plugin or ()),
                          allow_hosts=tuple(allow_host or ()))
    typer.echo(f"environment service on http://{host}:{port} ({workers} sandboxes, queue {max_queue}, "
               f"step timeout {step_timeout:g} s)", err=True)
    serve(opts, host=host, port=port, workers=workers, max_queue=max_queue)
