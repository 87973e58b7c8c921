"""A load of a folder zerodp cannot read says what the folder is and what to do (issue 40, part 4): another tool's
format, a half-written checkpoint, weights only, or nothing known; never "tag not found" for a tag that is there.
Every refusal leaves the engine and the files unchanged (assert_load_fails checks both)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.unit.checkpoint.test_checkpoint_local import assert_load_fails

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed_ckpt"


@pytest.fixture
def ds_copy(tmp_path) -> Path:
    """A copy of the stage-2 fp32 DeepSpeed fixture (2 ranks), to damage."""
    out = tmp_path / "ds"
    shutil.copytree(FIXTURES / "s2_fp32", out)
    return out


def test_deepspeed_checkpoint_missing_a_rank_file(ds_copy):
    (ds_copy / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    message = assert_load_fails(ds_copy, r"saved by 2 ranks but the optimizer files of ranks \[1\] .* are missing: it "
                                         r"is incomplete")
    assert "not found" not in message


def test_deepspeed_checkpoint_without_optimizer_files(ds_copy):
    for f in (ds_copy / "global_step3").glob("*optim_states.pt"):
        f.unlink()
    message = assert_load_fails(ds_copy, r"checkpoint 'global_step3' in .* cannot be loaded: .* is a DeepSpeed "
                                         r"checkpoint folder with a model states file but no ZeRO optimizer files")
    assert "stage 0" in message and "not found" not in message


def test_deepspeed_checkpoint_without_model_states(ds_copy):
    (ds_copy / "global_step3" / "mp_rank_00_model_states.pt").unlink()
    assert_load_fails(ds_copy, r"cannot be loaded: .* DeepSpeed ZeRO checkpoint folder with optimizer files but no "
                               r"model states file .* incomplete")


def test_truncated_deepspeed_file(ds_copy):
    path = ds_copy / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:1000])
    assert_load_fails(ds_copy, r"zero_pp_rank_0_mp_rank_00_optim_states.pt is not a readable torch.save file .* "
                               r"damaged or still being written")


def test_universal_folder_missing_a_parameter(tmp_path):
    out = tmp_path / "universal"
    shutil.copytree(FIXTURES / "universal", out)
    shutil.rmtree(out / "global_step3" / "zero" / "hidden.weight")
    assert_load_fails(out, r"universal checkpoint .* has no zero/hidden.weight/fp32.pt; it is incomplete")


def test_torch_dcp_folder(tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"x")
    assert_load_fails(tmp_path / "dcp", r"not a zerodp checkpoint directory: .* is a torch.distributed.checkpoint "
                                        r"\(DCP\) folder")


def test_half_written_zerodp_save(tmp_path):
    (tmp_path / "ckpt" / ".tmp-global_step5").mkdir(parents=True)
    assert_load_fails(tmp_path / "ckpt", r"holds only a zerodp save that never completed \(.tmp-global_step5/")


def test_hugging_face_folder(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    assert_load_fails(tmp_path / "hf", r"is a Hugging Face model folder .* weights only, no optimizer state")


def test_unknown_folder_named_by_latest(tmp_path):
    """The issue's case: `latest` names a tag folder that is there, in no format zerodp knows."""
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "global_step3" / "weights.npz").write_bytes(b"x")
    (ckpt / "latest").write_text("global_step3")
    message = assert_load_fails(ckpt, r"checkpoint 'global_step3' in .* cannot be loaded: .* is in none of the "
                                      r"formats zerodp reads \(zerodp, DeepSpeed ZeRO or universal, torch DCP\); it "
                                      r"holds: weights.npz")
    assert "not found" not in message


def test_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_load_fails(tmp_path / "empty", r"is not a zerodp checkpoint directory: .* is empty")


def test_deepspeed_checkpoint_with_model_parallelism(ds_copy):
    tag = ds_copy / "global_step3"
    (tag / "mp_rank_01_model_states.pt").write_bytes((tag / "mp_rank_00_model_states.pt").read_bytes())
    assert_load_fails(ds_copy, r"DeepSpeed checkpoint with model \(tensor\) parallelism .* convert it with DeepSpeed's "
                               r"ds_to_universal")
