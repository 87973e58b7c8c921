"""zerodp's MoE layer against DeepSpeed 0.19.8's `deepspeed.moe.layer.MoE`, one process (ep_size 1), same weights,
same input, same random draws: output, l_aux, exp_counts and every gradient, for top-1 and top-2 with and
without token drops, random token selection, second-expert sampling, the residual MLP. Run in the DeepSpeed
venv with this tree's zerodp first on the path (results in bench/results/moe_layer_vs_deepspeed.json):

    DS_ACCELERATOR=cpu PYTHONPATH=src /work/dsvenv/bin/python bench/moe_layer_vs_deepspeed.py

An expert that no token reached gets no gradient in zerodp (None: skipped by torch's optimizers) and a zero
gradient in DeepSpeed (it runs on zero-padded slots); those are compared as zeros and listed per case.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import deepspeed.moe.layer as ds_layer
import zerodp
from zerodp.deepspeed.moe.layer import MoE as ZerodpMoE

assert os.path.dirname(zerodp.__file__).startswith(os.path.abspath("src")), "run with PYTHONPATH=src"

CASES = {
    "top1-drop": dict(k=1, use_rts=False, min_capacity=0),
    "top1-drop-rts": dict(k=1, use_rts=True, min_capacity=0),
    "top1-nodrop": dict(k=1, drop_tokens=False, use_rts=False, min_capacity=0),
    "top1-capacity2-residual": dict(k=1, capacity_factor=2.0, use_rts=False, use_residual=True, min_capacity=0),
    "top2-drop": dict(k=2, top2_2nd_expert_sampling=False, min_capacity=0),
    "top2-drop-sampling": dict(k=2, top2_2nd_expert_sampling=True, min_capacity=0),
    "top2-nodrop": dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False, min_capacity=0),
    "top1-min-capacity4": dict(k=1, use_rts=False, min_capacity=4),
}
HIDDEN, EXPERTS, TOKENS = 8, 4, 24


def expert():
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 16), torch.nn.ReLU(), torch.nn.Linear(16, HIDDEN))


def run(options):
    torch.manual_seed(0)
    ds = ds_layer.MoE(HIDDEN, expert(), num_experts=EXPERTS, ep_size=1, **options)
    with torch.no_grad():
        for p in ds.parameters():
            p.copy_(torch.randn_like(p) * 0.5)  # distinct experts (DeepSpeed's start as copies of one)
    ours = ZerodpMoE(HIDDEN, expert(), num_experts=EXPERTS, ep_size=1, **options)
    ours.load_state_dict(ds.state_dict())
    x = torch.randn(TOKENS, HIDDEN)
    results = []
    for model in (ds, ours):
        xi = x.clone().requires_grad_()
        torch.manual_seed(1)  # the same draws for random token selection and second-expert sampling
        out, l_aux, counts = model(xi)
        (out.square().sum() + l_aux).backward()
        grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad) for n, p in model.named_parameters()}
        no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None)
        results.append((out.detach(), l_aux.detach(), counts, xi.grad, grads, no_grad))
    (o1, l1, c1, g1, p1, _), (o2, l2, c2, g2, p2, none2) = results
    diff = lambda a, b: float((a.float() - b.float()).abs().max())  # noqa: E731
    return {"output_max_abs_diff": diff(o1, o2), "l_aux": [float(l1), float(l2)],
            "exp_counts_equal": bool(torch.equal(c1.long(), c2.long())), "input_grad_max_abs_diff": diff(g1, g2),
            "param_grad_max_abs_diff": max(diff(p1[n], p2[n]) for n in p1),
            "zerodp_no_grad (DeepSpeed: zeros)": none2}


if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29761", rank=0, world_size=1)
    report = {"deepspeed": __import__("deepspeed").__version__, "torch": torch.__version__,
              "command": "DS_ACCELERATOR=cpu PYTHONPATH=src /work/dsvenv/bin/python bench/moe_layer_vs_deepspeed.py",
              "cases": {name: run(options) for name, options in CASES.items()}}
    dist.destroy_process_group()
    text = json.dumps(report, indent=1)
    print(text)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text + "\n")
