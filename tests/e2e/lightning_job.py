"""A PyTorch Lightning script as its users write it, run by tests/e2e/test_lightning.py as

    python -m zerodp.deepspeed.run lightning_job.py --out DIR

Lightning starts rank 1 itself (`[sys.executable, lightning_job.py, --out, DIR]`), which gets the
`deepspeed` alias through ZERODP_DEEPSPEED_ALIAS (set by zerodp.deepspeed.run). Both ranks then run the
same Trainers in turn, in one pair of processes (Lightning starts the processes once, for the first
Trainer): Lightning's DDP (the reference), `strategy="deepspeed_stage_1|2|3"`, `DeepSpeedStrategy(config=...)`,
then a stage-3 run saved half way with `trainer.save_checkpoint`, resumed with `fit(ckpt_path=...)`, and
converted by Lightning's `convert_zero_checkpoint_to_fp32_state_dict`. Each run's per-step losses and lrs
and its final parameters go to DIR/<run>.pt (rank 0).

On CPU, Lightning refuses DeepSpeed (with real DeepSpeed too) by two checks, the only things lifted here and
only without a GPU: DeepSpeedStrategy.setup_environment's "only supported on CUDA GPUs" and
`_validate_device_index_selection` (a CPU device has no index to match the local rank).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import DeepSpeedStrategy

STEPS = 6
GPU = torch.cuda.is_available()


class Regressor(pl.LightningModule):
    """A small MLP (no parameter with a zero true gradient), AdamW with weight decay, StepLR every 2 steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                       torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.losses, self.lrs, self.batches = [], [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.batches.append((self.trainer.current_epoch, batch_idx))
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    # 3 steps per epoch (2 ranks of 4): the checkpoint is saved at an epoch's end, where Lightning resumes exactly
    # (mid-epoch, it restarts a plain DataLoader from the epoch's first batch)
    x = torch.randn(24, 8, generator=g)
    y = torch.sin(x[:, :4]) + 0.1 * torch.randn(24, 4, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)  # Lightning adds a DistributedSampler


def strategy(name: str):
    if name == "ddp":
        return "ddp"
    if name.startswith("config_stage_"):  # DeepSpeedStrategy(config=...): a user's own DeepSpeed config
        return DeepSpeedStrategy(config={"zero_optimization": {"stage": int(name[-1]), "overlap_comm": True,
                                                               "contiguous_gradients": True},
                                         "zero_allow_untested_optimizer": True})
    return name  # "deepspeed_stage_1" ... "deepspeed_stage_3"


def full_parameters(trainer: pl.Trainer, module: Regressor) -> dict:
    """The whole parameters on every rank (gathered at stage 3, as a DeepSpeed user gathers them)."""
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {k: v.detach().clone() for k, v in module.named_parameters()}
    return {k: v.detach().clone() for k, v in module.named_parameters()}


class SaveAfterFirstEpoch(pl.Callback):
    """`trainer.save_checkpoint` at the end of the first epoch (where ModelCheckpoint saves), with the whole
    parameters at that point (to compare the converted checkpoint with)."""

    def __init__(self, path: str):
        self.path, self.params = path, None

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)
            self.params = full_parameters(trainer, module)


def fit(name: str, ckpt_path=None, callbacks=()) -> tuple[pl.Trainer, Regressor]:
    module = Regressor()
    trainer = pl.Trainer(accelerator="gpu" if GPU else "cpu", devices=2, strategy=strategy(name), max_steps=STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, callbacks=list(callbacks),
                         enable_model_summary=False, num_sanity_val_steps=0, precision="32-true")
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer, module


def record(out: str, run: str, trainer: pl.Trainer, module: Regressor, **extra) -> None:
    params = full_parameters(trainer, module)
    if trainer.global_rank == 0:
        torch.save({"losses": module.losses, "lrs": module.lrs, "batches": module.batches, "params": params,
                    "global_step": trainer.global_step, **extra}, os.path.join(out, f"{run}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--runs", default="ddp,deepspeed_stage_1,deepspeed_stage_2,config_stage_2,deepspeed_stage_3")
    parser.add_argument("--resume", action="store_true", help="save DDP's run and the last run after their first "
                        "epoch, resume both, and convert the last one's checkpoint to one fp32 state dict")
    args = parser.parse_args()
    if not GPU:
        # the two Lightning checks lifted on CPU (see the module docstring)
        import lightning.pytorch.strategies.deepspeed as lightning_deepspeed

        DeepSpeedStrategy.setup_environment = lambda self: super(DeepSpeedStrategy, self).setup_environment()
        lightning_deepspeed._validate_device_index_selection = lambda devices: None
    runs = args.runs.split(",")
    # Lightning resumes from a checkpoint saved at an epoch's end by re-entering that epoch (one batch, the
    # epoch's first) and then starting the next epoch from its first batch: not the uninterrupted run's
    # batches, so the resumed run is compared with Lightning's own DDP run saved and resumed the same way
    resumed = ["ddp", runs[-1]] if args.resume else []
    savers = {run: SaveAfterFirstEpoch(os.path.join(args.out, f"{run}_epoch0.ckpt")) for run in resumed}
    for run in runs:
        trainer, module = fit(run, callbacks=[savers[run]] if run in savers else ())
        record(args.out, run, trainer, module)
    for run in resumed:
        trainer, module = fit(run, ckpt_path=savers[run].path)
        record(args.out, f"{run}_resumed", trainer, module, epoch0_params=savers[run].params)
    if args.resume and trainer.global_rank == 0:
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(savers[runs[-1]].path, os.path.join(args.out, "epoch0_fp32.pt"))

if __name__ == "__main__":
    main()
