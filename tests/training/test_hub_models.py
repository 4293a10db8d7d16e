"""A model named as a user names it: a folder, or a hub id found in the local Hugging Face cache; bad folders are
refused before anything slow starts, naming the file and the fix."""

import json
import shutil

import pytest

from rlpipe.training.models import fetch_source, model_context


def _cache(tmp_path, monkeypatch, folder, repo="acme/standin-qwen2", commit="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face hub cache laid out as huggingface_hub writes it (models--ORG--NAME/snapshots, refs)."""
    root = tmp_path / "hub"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(folder, repo_dir / "snapshots" / commit)
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(root))
    return repo_dir / "snapshots" / commit


def test_hub_id_resolves_from_the_local_cache(standins, tmp_path, monkeypatch, rlpipe_home):
    from rlpipe.config import settings

    snap = _cache(tmp_path, monkeypatch, standins["qwen2"])
    assert fetch_source("acme/standin-qwen2", settings()) == snap
    assert fetch_source("acme/standin-qwen2@main", settings()) == snap


def test_uncached_hub_id_names_the_id_and_how_to_fetch_it(standins, tmp_path, monkeypatch):
    from rlpipe.config import settings

    _cache(tmp_path, monkeypatch, standins["qwen2"])
    with pytest.raises(FileNotFoundError, match=r"'Qwen/Qwen2.5-0.5B-Instruct' is neither a local folder nor in the "
                                                r"Hugging Face cache .*hf download Qwen/Qwen2.5-0.5B-Instruct"):
        fetch_source("Qwen/Qwen2.5-0.5B-Instruct", settings())


def test_folder_that_is_not_a_causal_lm_is_refused(standins, tmp_path):
    from rlpipe.config import settings

    bad = tmp_path / "bert"
    shutil.copytree(standins["qwen2"], bad)
    cfg = json.loads((bad / "config.json").read_text()) | {"architectures": ["BertForMaskedLM"]}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"describes \['BertForMaskedLM'\], not a causal language model"):
        fetch_source(str(bad), settings())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        fetch_source(str(tmp_path / "empty"), settings())


def test_tokenizer_of_another_model_is_refused(standins, tmp_path):
    """The Llama stand-in's tokenizer (1000 ids) on the Qwen stand-in's weights (716 rows)."""
    from rlpipe.config import settings

    mixed = tmp_path / "mixed"
    shutil.copytree(standins["qwen2"], mixed)
    shutil.copy(standins["llama"] / "tokenizer.json", mixed / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer .* has token id 999, the model's embeddings only 716 rows"):
        fetch_source(str(mixed), settings())


def test_model_context_is_the_checkpoints_own(standins):
    assert model_context(standins["qwen2"]) == 8192


def test_a_reward_model_folder_rlpipe_saved_is_accepted(tiny_reward_model):
    """The same trunk with a scalar head (*ForTokenClassification) is a model rlpipe loads, not a refusal."""
    from rlpipe.config import settings

    folder = tiny_reward_model[0]
    assert json.loads((folder / "config.json").read_text())["architectures"][0].endswith("ForTokenClassification")
    assert fetch_source(str(folder), settings()) == folder
