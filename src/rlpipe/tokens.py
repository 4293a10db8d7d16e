"""What a checkpoint says about its text: end tokens, the pad token, the chat template.

The checkpoint decides these, not rlpipe (``ARCHITECTURE.md``, "Models"); every place that turns text into
tokens or decides where a response ends asks here. Hub checkpoints disagree on the form: Qwen2's
``generation_config.json`` gives EOS as an int, Llama-3's as a list; Llama-3 has no pad token at all.
No heavy imports: engines, the trainer and the services all stand on this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["encode_chat_turn", "encode_prompt", "eos_ids", "folder_eos_ids", "ensure_pad_token", "load_tokenizer", "render_prompt", "require_chat_template"]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        return [int(v) for v in value]
    raise TypeError(f"eos_token_id must be an int or a list of ints, not {value!r}")


def eos_ids(eos_token_id: Any, tokenizer: Any, override: Iterable[int | str] | None = None) -> set[int]:
    """The token ids that end a response: ``override`` when given (ids or token strings, e.g. from
    ``rollout.stop_tokens``), else the generation config's ``eos_token_id`` (an int or a list) together with the
    tokenizer's EOS, as vLLM stops on both."""
    if override is not None:
        out = set()
        for t in override:
            tid = t if isinstance(t, int) else tokenizer.convert_tokens_to_ids(t)
            if tid is None or (isinstance(t, str) and tid == getattr(tokenizer, "unk_token_id", object())):
                raise ValueError(f"stop token {t!r} is not in the model's vocabulary")
            out.add(int(tid))
        return out
    out = set(_as_ids(eos_token_id))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.add(int(tokenizer.eos_token_id))
    if not out:
        raise ValueError("the model names no end token: neither generation_config.json nor the tokenizer has "
                         "eos_token_id; set rollout.stop_tokens in the config")
    return out


def ensure_pad_token(tokenizer: Any) -> Any:
    """Give a tokenizer without a pad token (Llama-3) one: its EOS, as TRL and verl do.

    Padding never carries loss or attention in rlpipe (attention masks and loss masks are built from lengths),
    so which id fills it does not change any number; it only has to exist for batching."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with; add a pad token "
                             "to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def require_chat_template(tokenizer: Any, where: str) -> None:
    """Refuse chat-message data for a tokenizer that has no chat template (before anything slow starts)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: the data are chat messages but the model's tokenizer has no chat template; "
                         "use a checkpoint with one (tokenizer_config.json 'chat_template' or chat_template.jinja), "
                         "or give the prompts as plain text")


def load_tokenizer(folder: Any) -> Any:
    """A checkpoint's own tokenizer, with a pad token (:func:`ensure_pad_token`): every tokenizer rlpipe loads
    comes from here, so none is without one."""
    from transformers import AutoTokenizer

    return ensure_pad_token(AutoTokenizer.from_pretrained(folder))


def render_prompt(tokenizer: Any, prompt: str, chat: bool) -> str:
    """The text the model sees before its answer: plain text, or the chat template with a generation prompt."""
    if chat:
        import json

        require_chat_template(tokenizer, "chat prompt")
        return tokenizer.apply_chat_template(json.loads(prompt), tokenize=False, add_generation_prompt=True)
    return prompt


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids as the checkpoint expects them. A chat template writes its own special tokens
    (Llama-3's ``<|begin_of_text|>``), so rendered chat is encoded without adding any; plain text gets the
    tokenizer's own (a Llama BOS, nothing for Qwen), as ``generate`` and vLLM's completion API give it."""
    return list(tokenizer(render_prompt(tokenizer, prompt, chat), add_special_tokens=not chat)["input_ids"])


def folder_eos_ids(folder: Any, tokenizer: Any, override: Iterable[int | str] | None = None) -> set[int]:
    """:func:`eos_ids` of a checkpoint folder: its ``generation_config.json`` (else ``config.json``)."""
    import json
    from pathlib import Path

    folder = Path(folder)
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.exists():
            cfg = json.loads(path.read_text())
            if cfg.get("eos_token_id") is not None or override is not None:
                return eos_ids(cfg.get("eos_token_id"), tokenizer, override)
    return eos_ids(None, tokenizer, override)


def encode_chat_turn(tokenizer: Any, messages: list[dict[str, Any]], response: str) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of a chat row as the model's template writes the whole conversation: the
    response is the assistant's content and the template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``),
    which is what generation stops on. The tokenizer's ``eos_token`` may be another token (a base Qwen's
    ``<|endoftext|>``): appending it would teach an ending the template never writes. The template's trailing
    text after the end token (a newline) is left out."""
    import json

    prompt = render_prompt(tokenizer, json.dumps(messages), chat=True)
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"]
    tail = full[len(prompt):]
    if not full.startswith(prompt) or not tail.startswith(response):
        raise ValueError("the chat template does not write the assistant's turn after its generation prompt; "
                         "training on chat needs a template where it does (render it with add_generation_prompt=True "
                         "and compare)")
    rest = tokenizer(tail[len(response):], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    end = next((i for i, t in enumerate(rest) if t in special), None)
    return list(p), list(r) + (rest[: end + 1] if end is not None else [tokenizer.eos_token_id])
