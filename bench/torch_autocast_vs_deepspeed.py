"""torch_autocast: DeepSpeed 0.19.8 against zerodp on the parity model (tests/dist/common.py), 2 gloo ranks,
AdamW, GAS 2, 3 steps; prints each rank's per-step losses and per-tensor parameter sums. Run (results in
bench/results/torch_autocast_vs_deepspeed.md):

    DS_ACCELERATOR=cpu ENGINE=deepspeed STAGE=3 bench/.venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/torch_autocast_vs_deepspeed.py
    ENGINE=zerodp STAGE=3 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 bench/torch_autocast_vs_deepspeed.py
"""
import json, os, sys
import torch, torch.nn.functional as F
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from tests.dist.common import make_model, param_groups, micro_batch
ENGINE = os.environ["ENGINE"]
STAGE = int(os.environ["STAGE"])
if ENGINE == "deepspeed":
    import deepspeed
else:
    import zerodp.deepspeed as deepspeed
deepspeed.init_distributed("gloo")
import torch.distributed as dist
rank, world = dist.get_rank(), dist.get_world_size()
model = make_model()
cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
       "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
       "zero_optimization": {"stage": STAGE}}
opt = torch.optim.AdamW(param_groups(model, 1e-2), lr=1e-2)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
losses = []
for step in range(3):
    tot = 0.0
    for micro in range(2):
        x, y = micro_batch(step, micro, rank, world, 2, 2)
        loss = F.mse_loss(engine(x).float(), y)
        engine.backward(loss); engine.step()
        tot += loss.item()
    losses.append(tot)
out = {"rank": rank, "losses": losses}
if STAGE == 3 and ENGINE == "deepspeed":
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["params"] = {k: v.detach().float().sum().item() for k, v in model.state_dict().items()}
elif STAGE == 3:
    import zerodp
    with zerodp.gathered_parameters(model.parameters()):
        out["params"] = {k: v.detach().float().sum().item() for k, v in model.state_dict().items()}
else:
    out["params"] = {k: v.detach().float().sum().item() for k, v in model.state_dict().items()}
print("RESULT", json.dumps(out))
