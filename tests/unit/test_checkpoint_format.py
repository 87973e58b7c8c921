"""The checkpoint file format without any engine: the streaming safetensors writer, checksums, tag
names, and the range arithmetic that lets a new layout find its slices among the saved ones."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zerodp import CheckpointError
from zerodp.checkpoint import format as fmt


def test_tensor_file_is_plain_safetensors_and_its_checksum_is_the_files(tmp_path):
    flat = torch.arange(20, dtype=torch.float32)
    tensors = {
        "master/a.weight/0-7": flat[3:10],  # a view into a larger buffer: written without a copy
        "exp_avg/a.weight/0-7": flat[10:17] * 2,
        "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "steps": torch.tensor([3, 4], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "matrix": torch.arange(6, dtype=torch.float16).view(2, 3),
    }
    path = tmp_path / "x.safetensors"
    digest = fmt.write_tensor_file(path, tensors, {"rank": "0"})
    assert digest == fmt.sha256_file(path)
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for key, t in tensors.items():
        assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"rank": "0"}
        assert torch.equal(f.get_slice("master/a.weight/0-7")[2:5], flat[5:8])


def test_unsupported_dtype_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="complex64"):
        fmt.write_tensor_file(tmp_path / "x.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})


def test_overlapping_finds_the_saved_pieces_of_a_new_range():
    # a 10-element parameter saved as [0, 4) on rank 0 and [4, 10) on rank 1 (master index 2)
    saved = [[1, 4, 10, 2], [0, 0, 4, 0]]
    assert list(fmt.overlapping(saved, 2, 7)) == [(0, 0, 4, 0, 2, 4), (1, 4, 10, 2, 4, 7)]
    assert list(fmt.overlapping(saved, 5, 6)) == [(1, 4, 10, 2, 5, 6)]
    assert list(fmt.overlapping([], 0, 0)) == []


@pytest.mark.parametrize("saved", [[[0, 0, 4, 0]], [[0, 0, 4, 0], [1, 5, 10, 0]]])
def test_overlapping_refuses_a_gap(saved):
    with pytest.raises(CheckpointError, match="do not cover elements"):
        list(fmt.overlapping(saved, 0, 10))


@pytest.mark.parametrize("tag", ["", ".tmp-x", "a/b", "latest", " x", None])
def test_bad_tags_are_refused(tag):
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        fmt.validate_tag(tag)


def test_tag_resolution(tmp_path):
    for tag in ("step1", "step2"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / fmt.META_FILE).write_text("{}")
    (tmp_path / ".tmp-step3").mkdir()  # a crashed save: not a tag
    assert fmt.available_tags(tmp_path) == ["step1", "step2"]
    with pytest.raises(CheckpointError, match=r"no 'latest' file \(deleted\?\); name the checkpoint: load_checkpoint\(dir, tag=T\), or --tag T "
                       r"with zerodp train/consolidate, for T among the available tags: step1, step2"):
        fmt.resolve_tag_dir(tmp_path)
    fmt.write_text_atomically(tmp_path / fmt.LATEST_FILE, "step2\n")
    assert fmt.resolve_tag_dir(tmp_path) == tmp_path / "step2"
    assert fmt.resolve_tag_dir(tmp_path, "step1") == tmp_path / "step1"
    assert fmt.resolve_tag_dir(tmp_path / "step1") == tmp_path / "step1"  # a tag directory itself
    # a save overwriting step2 died between moving the old copy aside and renaming the new one in
    (tmp_path / "step2").rename(tmp_path / ".trash-step2")
    assert fmt.resolve_tag_dir(tmp_path) == tmp_path / ".trash-step2"
    with pytest.raises(CheckpointError, match=r"tag 'step9' not found .* \(available tags: step1\)"):
        fmt.resolve_tag_dir(tmp_path, "step9")
