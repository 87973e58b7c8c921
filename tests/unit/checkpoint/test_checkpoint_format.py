"""The checkpoint file format without any engine: the streaming safetensors writer, checksums, tag
names, and the range arithmetic that lets a new layout find its slices among the saved ones."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from zerodp import CheckpointError
from zerodp.checkpoint import format as fmt
from zerodp.checkpoint.tensor_reader import TensorFileReader


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


def test_a_tensor_stream_is_written_as_produced_and_read_back_by_ranges(tmp_path):
    """What a checkpoint's shard file is (units.py): a header declared first, values produced one by one;
    `TensorFileReader` reads element ranges of it with plain reads, as safetensors itself would."""
    values = {"master/w/0-6": torch.arange(6, dtype=torch.float32),
              "exp_avg/w/0-6": torch.ones(6, dtype=torch.bfloat16), "matrix": torch.arange(12, dtype=torch.int32).view(3, 4), "empty": torch.zeros(0)}
    produced = []

    def produce():
        for key, value in values.items():
            produced.append(key)  # nothing is made before the writer asks for it
            yield key, value

    specs = [(k, v.dtype, tuple(v.shape)) for k, v in values.items()]
    path = tmp_path / "s.safetensors"
    digest = fmt.write_tensor_file(path, fmt.TensorStream(specs, produce()), {"rank": "1"})
    assert produced == list(values) and digest == fmt.sha256_file(path)
    loaded = load_file(path)
    for key, value in values.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    reader = TensorFileReader(path)
    assert torch.equal(reader.read("master/w/0-6", 2, 5), torch.tensor([2.0, 3.0, 4.0]))
    assert torch.equal(reader.read("matrix", 5, 7), torch.tensor([5, 6], dtype=torch.int32))  # flattened
    assert torch.equal(reader.get_tensor("matrix"), values["matrix"])
    assert reader.read("empty", 0, 0).numel() == 0
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        reader.read("nope", 0, 1)
    with pytest.raises(CheckpointError, match=r"elements \[4, 8\) of 'master/w/0-6' requested, but it has 6"):
        reader.read("master/w/0-6", 4, 8)
    reader.close()


def test_a_stream_that_disagrees_with_its_header_is_an_error(tmp_path):
    specs = [("a", torch.float32, (2,)), ("b", torch.float32, (3,))]
    with pytest.raises(CheckpointError, match="does not match the header's entry"):
        fmt.write_tensor_file(tmp_path / "x.safetensors", fmt.TensorStream(specs, iter([("a", torch.zeros(3))])))
    with pytest.raises(CheckpointError, match="were never written"):
        fmt.write_tensor_file(tmp_path / "y.safetensors", fmt.TensorStream(specs, iter([("a", torch.zeros(2))])))


def test_a_truncated_tensor_file_is_reported(tmp_path):
    path = tmp_path / "t.safetensors"
    fmt.write_tensor_file(path, {"x": torch.arange(1000, dtype=torch.float32)})
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        TensorFileReader(path).read("x", 900, 1000)


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


def test_tensors_copied_on_their_way_to_the_file_are_written_intact(tmp_path):
    """Issue 31 item 1: the writer copies a tensor that is not a contiguous CPU tensor (`.cpu()` of a GPU
    tensor, `.contiguous()` of a strided one) and wrote the copy's bytes after it was freed: on one H100
    every bias and small weight of a checkpoint was garbage. Transposed tensors take the same copy on CPU;
    small ones (<= 1 KiB) are the ones malloc reuses at once, and all 40 came back corrupted before the fix."""
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(5, 3 + i % 7).t() for i in range(40)}
    tensors["bf16"] = torch.randn(3, 4).to(torch.bfloat16).t()
    path = tmp_path / "x.safetensors"
    digest = fmt.write_tensor_file(path, tensors)
    assert digest == fmt.sha256_file(path)
    reader = TensorFileReader(path)
    for key, t in tensors.items():
        assert torch.equal(reader.get_tensor(key), t), key


def test_tensor_bytes_keeps_its_tensor_alive_and_refuses_what_it_cannot_view():
    import gc
    import weakref

    t = torch.arange(6, dtype=torch.float32)
    alive = weakref.ref(t)
    view = fmt.tensor_bytes(t)
    del t
    gc.collect()
    assert alive() is not None and bytes(view) == torch.arange(6, dtype=torch.float32).numpy().tobytes()
    del view
    gc.collect()
    assert alive() is None
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        fmt.tensor_bytes(torch.zeros(3, 2).t())
