"""The weight digest: BLAKE3 over (name, dtype, shape, bytes) in name order, and digests recorded before the
change to it (sha256 over the same fields) still matching their weights."""

import hashlib

import blake3
import pytest
import torch
from safetensors.torch import save_file

from rlpipe.storage.weights import digest_matches, file_digest_matches, file_weights_digest, weights_digest


def _by_hand(h, tensors: dict[str, torch.Tensor]) -> str:
    for name in sorted(tensors):
        t = tensors[name]
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(4, generator=g),
            "c.empty": torch.zeros(0), "d.half": torch.randn(2, 2, generator=g).to(torch.float16)}


def test_the_digest_is_blake3_of_the_documented_fields_in_name_order(tensors):
    digest = weights_digest(tensors)
    assert digest == _by_hand(blake3.blake3(), tensors) and len(digest) == 64
    assert weights_digest(list(reversed(list(tensors.items())))) == digest  # order-free


def test_a_digest_recorded_before_the_change_still_matches_and_a_wrong_one_does_not(tensors, tmp_path):
    legacy = _by_hand(hashlib.sha256(), tensors)
    assert legacy != weights_digest(tensors)
    assert digest_matches(legacy, tensors) and digest_matches(weights_digest(tensors), tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    assert file_weights_digest(tmp_path) == weights_digest(tensors)
    assert file_digest_matches(tmp_path, legacy)
    changed = dict(tensors, **{"a.bias": tensors["a.bias"] + 1e-6})
    assert not digest_matches(legacy, changed) and not digest_matches(weights_digest(tensors), changed)
    assert not digest_matches("0" * 64, tensors)


def test_a_folder_without_weights_is_an_error_not_a_digest(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no"):
        file_weights_digest(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no"):
        file_digest_matches(tmp_path, "0" * 64)
